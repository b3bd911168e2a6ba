"""What `safe_predict`, `safe_evaluate` and `safe_generate` are made of.

- `loop`: Keras's callbacks, progress bar and stop flags around `run_in_pieces`;
- `steps`: the compiled predict and test steps, cached per model;
- `outputs`: where each piece's outputs go, in order, on the host;
- `output_losses`: per-output losses over pieces, as Keras counts them;
- `generation`: `safe_generate`'s pieces (prompts as rows, few batch shapes)."""
