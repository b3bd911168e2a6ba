"""One analysis of a model, shared by `memory_report` and `place`.

Modules, one concept each (imports point down this list):

- `sizes`: the one byte counter (tensors per sample, variables, under a
  dtype policy) and the one optimizer-slot counter;
- `graph`: the traced layer graph (one symbolic forward pass through
  `keras_memfit.backend.get().trace_layer_calls`), its cuts, working sets and
  the bytes per sample crossing between any set of top-level layers and the
  rest;
- `flops`: forward FLOPs per sample of a traced call;
- `peak`: the one peak formula, for the model and per device;
- `model`: `ModelAnalysis`, the above for one model, row by row (and
  `training_peak`, its training estimate at a number of rows, made lazily);
- `segments`: the cut of a sequence of calls into segments to recompute
  with the lowest backward peak;
- `backward`: one layer's own backward need (what no recomputation frees);
- `choice`: which cheap layers `place` pins for a budget;
- `report_text`: the text table of a `MemoryReport`.

`keras_memfit.report` and `keras_memfit.placement` are the public front ends.
"""

from keras_memfit.analysis.model import (
    ModelAnalysis,
    Row,
    analyse,
    check_built,
    short_device,
    training_peak,
)

__all__ = ["ModelAnalysis", "Row", "analyse", "check_built", "short_device", "training_peak"]
