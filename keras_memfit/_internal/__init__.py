"""Private helpers under everything else: Keras's private API, model state, caches, checks, units.

- `keras_compat`: every use of Keras's private API shared by the backends,
  with the Keras range it was tested on;
- `model_state`: what a compiled model holds, read through Keras's public API;
- `reductions`: how a part of a batch weighs in the batch's loss, by the
  model's loss reductions;
- `batches`: Keras's batches as chunks of rows, packed as Keras packs them,
  and what MemFit cannot split;
- `cache`: compiled steps and guards kept per model;
- `validate`: the argument checks shared by the public functions;
- `units`: human-readable sizes, counts, shapes and tables;
- `legacy`: recognising Keras 2 (`tf_keras`) objects;
- `lengths`: the length given to an input dimension a model leaves unknown.

Nothing here imports another keras_memfit layer except the backend seam
(`keras_memfit.backend`), and the backend packages themselves build on the
modules that import nothing of keras_memfit (`keras_compat`, `model_state`,
`units`, `batches`) and on `reductions`. See ARCHITECTURE.md for the layers.
"""
