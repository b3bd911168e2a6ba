"""PyTorch implementation of the backend seam (see `keras_memfit.backend.base`).

One module per concern, the eight that provide the seam's protocols in every
backend package (`base.CONCERNS`); `assemble` below makes their members this
package's.

- `oom`: PyTorch's OOM forms, the bases of `OutOfMemoryError`;
- `memory`: CUDA's caching allocator (nothing on the CPU);
- `steps`: predict and test steps under `torch.no_grad()`, guards;
- `training`: train steps that say how far a failed call got, and gradient
  accumulation;
- `trainer`: Keras's step functions in torch's calling convention;
- `devices`: naming devices (`place` is not implemented);
- `tracing`: the model's layer calls, traced on the "meta" device;
- `distribution`: one process on one device (`torch.distributed` refused).

Keras's torch trainer runs its steps eagerly and updates the weights in
place; nothing is donated, so an OOM in a forward or backward pass leaves the
model's weights as they were. What a failed step may already have changed
(the loss tracker, metrics, BatchNorm statistics, RNG seeds) is snapshotted
and restored (`steps.VariableGuard`, `training.TrainStep`); the train step
knows whether its optimizer update had begun. After an OOM the next step
returns PyTorch's cached CUDA blocks first (`torch.cuda.empty_cache()`).
Memory statistics come from CUDA's caching allocator; the CPU has none (the
planner learns from the first OOM). `memory_report` traces the model on the
"meta" device (`tracing`). Not implemented: `place` (`devices`) raises
`NotImplementedError`; `torch.distributed` is refused (`distribution`). Models
compiled with `jit_compile=True` run keras_memfit's steps eagerly (no
`torch.compile`).
"""

from keras_memfit.backend import assemble

assemble(__name__)
