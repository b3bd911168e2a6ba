"""MemFit's algorithm behind the thin callback in `keras_memfit.callbacks`.

- `run`: one `fit` call's training, validation and predict batches, in
  pieces (`Run`);
- `layout`: how a batch is cut into pieces and what runs them: one device,
  or the replicas of a `tf.distribute` strategy;
- `remat`: the rung after splitting, layers recomputed in the backward
  pass where one sample does not fit (`Rematerialization`);
- `summary`: what MemFit reports at the end of `fit`;
- `batch_dependence`: what makes a split batch differ from the whole one,
  and MemFit's warning about it.
"""
