"""What `safe_predict` and `safe_evaluate` are made of: their batch loop, steps, outputs, losses.

- `loop`: Keras's plumbing (callbacks, progress bar, stop flags) around
  `planning.runner.run_in_pieces`;
- `steps`: the compiled predict and test steps, cached per model (MemFit's
  `predict` and validation run them too);
- `outputs`: where each piece's outputs go, in order, on the host;
- `output_losses`: exact per-output losses over pieces;
- `generation`: `safe_generate`'s pieces (prompts as rows, few batch shapes,
  outputs in order).
"""
