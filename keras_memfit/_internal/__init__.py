"""Private helpers, the bottom layer: these modules import only one another (ARCHITECTURE.md).

- `keras_compat`: every use of Keras's private API, and its tested range;
- `model_state`: what a compiled model holds, read through Keras's public API;
- `reductions`: how a part of a batch weighs in the batch's loss;
- `batches`: batches as chunks of rows, and what cannot split;
- `kinds`: what kind of tensor a value is, importing no framework;
- `cache`: compiled steps and guards kept per model;
- `validate`: the argument checks shared by the public functions;
- `units`: human-readable sizes, counts, shapes and tables;
- `legacy`: recognising Keras 2 (`tf_keras`) objects;
- `sequence_lengths`: the length given to input dimensions a model leaves unknown.
"""
