"""TensorFlow implementation of the backend seam (see `keras_memfit.backend.base`).

One module per concern; the first eight provide the seam's protocols, as in
every backend package (`base.CONCERNS`), and `assemble` below makes their
members this package's.

- `oom`: TensorFlow's OOM forms, the bases of `OutOfMemoryError`;
- `memory`: memory statistics and limits of TensorFlow's devices;
- `steps`: compiled predict and test steps, their traced outputs, guards;
- `training`: train steps that say how far a failed call got (under XLA
  split as JAX's are);
- `trainer`: Keras's step functions in TensorFlow's calling convention;
- `devices`: naming devices, moving variables, pinning calls (`place`);
- `tracing`: the model's layer calls, traced symbolically;
- `distribution`: the seam's answers about `tf.distribute` strategies (from
  `replicas` and `distribute`);
- `replicas`: the inference steps on every replica of a
  `tf.distribute.MirroredStrategy` (used by `steps` and `distribution`);
- `distribute`: MemFit's train, test and predict steps under a
  `tf.distribute` strategy;
- `accumulation`: gradient accumulation on one device;
- `default_step`: Keras's default train step, in the parts MemFit's steps
  are made of;
- `holds`: what a compiled step that updates variables holds while it runs
  under XLA.
"""

from keras_memfit.backend import assemble

assemble(__name__)
