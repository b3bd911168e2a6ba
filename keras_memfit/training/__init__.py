"""MemFit's algorithm behind the thin callback in `keras_memfit.callbacks`.

- `run`: one call's batches, in pieces (`Run`);
- `layout`: how a batch is cut into pieces and what runs them;
- `remat`: layers recomputed in the backward pass where one sample does not fit;
- `summary`: what MemFit reports at the end of a call;
- `batch_dependence`: what makes a split batch differ from the whole one, and its warnings.
"""
