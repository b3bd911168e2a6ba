"""Private helpers under everything else: Keras's private API, model state, caches, checks, units.

- `keras_compat`: every use of Keras's private API shared by the backends, and its tested range;
- `model_state`: what a compiled model holds, read through Keras's public API;
- `reductions`: how a part of a batch weighs in the batch's loss, by the loss reductions;
- `batches`: batches as chunks of rows: cutting rows, packed as Keras packs them, what cannot split;
- `kinds`: what kind of tensor a value is, by class, importing no framework;
- `cache`: compiled steps and guards kept per model;
- `validate`: the argument checks shared by the public functions;
- `units`: human-readable sizes, counts, shapes and tables;
- `legacy`: recognising Keras 2 (`tf_keras`) objects;
- `sequence_lengths`: the length given to an input dimension a model leaves unknown.

The bottom layer: these modules import only one another (ARCHITECTURE.md).
"""
