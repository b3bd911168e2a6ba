"""JAX implementation of the backend seam (see `keras_memfit.backend.base`).

One module per concern; the first eight provide the seam's protocols, as in
every backend package (`base.CONCERNS`), and `assemble` below makes their
members this package's.

- `oom`: JAX's OOM forms, the bases of `OutOfMemoryError`;
- `memory`: memory statistics and limits of JAX's devices (the address-space
  limit on the CPU);
- `steps`: compiled predict and test steps, also started without waiting;
- `training`: train steps that never lose the model's state to an OOM; the
  variant (one device, `DataParallel`, several processes) chosen once;
- `trainer`: Keras's step functions in JAX's calling convention;
- `devices`: naming devices (`place` is not implemented);
- `tracing`: the model's layer calls, traced with `jax.eval_shape`;
- `distribution`: `keras.distribution.DataParallel`: pieces laid out over
  the devices; which variant the steps run as; evaluate under processes;
- `accumulation`: gradient accumulation's programs and accumulator;
- `state`: Keras's JAX state tuple threaded through MemFit's steps;
- `processes`: several JAX processes: their agreement, local copies, sums;
- `process_training`: MemFit's train step and accumulator under several
  processes.

Keras's JAX trainer donates the model's state to its compiled steps, so an
out-of-memory error loses the model. Here what can run out of memory donates
nothing and writes the new state only once it succeeded (see `steps`); the
train step's optimizer update, which needs no memory that grows with the
batch, runs as a second program that updates the state in place
(`training.TrainStep`). Inside Keras's loops the steps work on Keras's own
state tuple (see `state`).
`memory_report` traces the model with `jax.eval_shape` (`tracing`). Not
implemented yet: `place` (`devices`) raises `NotImplementedError`.
"""

from keras_memfit.backend import assemble

assemble(__name__)
