"""One analysis of a model, shared by `memory_report` and `place`; imports point down this list.

- `sizes`: the one byte counter and the one optimizer-slot counter;
- `graph`: the traced layer graph, its cuts, working sets and bytes crossing;
- `flops`: forward FLOPs per sample of a traced call;
- `peak`: the one peak formula, for the model and per device;
- `model`: `ModelAnalysis`, the above for one model, row by row;
- `segments`: the cut of a sequence of calls into segments to recompute;
- `backward`: one layer's own backward need (what no recomputation frees);
- `placement_choice`: which cheap layers `place` pins for a budget;
- `report_text`: the text table of a `MemoryReport`."""

from keras_memfit.analysis.model import ModelAnalysis, Row, analyse, short_device, training_peak

__all__ = ["ModelAnalysis", "Row", "analyse", "short_device", "training_peak"]
