"""The one estimate of a step's peak memory: `fixed + batch_size * per_sample`.

- Inference: weights (+ slots once built); per sample, the inputs and the largest live set.
- Training: weights, slots, gradients and `UPDATE_WORKING_COPIES` of the largest trainable
  weight; per sample, the inputs, every activation and `BACKWARD_WORKING_COPIES` of the largest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from keras_memfit.analysis.graph import LayerGraph

# The backward pass holds the gradients flowing into and out of a layer.
BACKWARD_WORKING_COPIES = 2
# The update's weight-sized temporaries (sparse gradients densified), one variable at a time.
UPDATE_WORKING_COPIES = 2


class Step(NamedTuple):
    """One top-level call as the estimate sees it, bytes per sample (as in `Row`)."""

    produced: int
    working: int
    cut: int


class VariableBytes(NamedTuple):
    """One variable as the estimate sees it (`device` in short form, "" before it is created)."""

    device: str
    nbytes: int
    slot_bytes: int
    trainable: bool


@dataclasses.dataclass
class DeviceMemory:
    """The peak estimate of a model, or of one of the devices its variables span."""

    device: str
    param_bytes: int
    slot_bytes: int
    fixed_bytes: int
    bytes_per_sample: int

    def peak_bytes_at(self, batch_size: int) -> int:
        return self.fixed_bytes + batch_size * self.bytes_per_sample

    def to_dict(self) -> Dict[str, Any]:
        """The estimate as a JSON-serialisable dict."""
        return dataclasses.asdict(self)


def estimate(
    steps: Sequence[Step],
    variables: Sequence[VariableBytes],
    input_bytes: int,
    *,
    training: bool,
    slots_resident: bool,
    device: Optional[str] = None,
) -> DeviceMemory:
    """The module's estimate over `variables` (all, or one device's)."""
    params = sum(v.nbytes for v in variables)
    slots = sum(v.slot_bytes for v in variables)
    trainable = [v.nbytes for v in variables if v.trainable]
    if training:
        produced = [s.produced for s in steps]
        fixed = params + slots + sum(trainable) + UPDATE_WORKING_COPIES * max(trainable, default=0)
        per_sample = input_bytes + sum(produced) + \
            BACKWARD_WORKING_COPIES * max(produced, default=0)
    else:
        fixed = params + (slots if slots_resident else 0)
        live, previous_cut = 0, input_bytes
        for step in steps:
            live = max(live, previous_cut + step.working)
            previous_cut = step.cut
        per_sample = input_bytes + live
    return DeviceMemory(device or "", params, slots, fixed, per_sample)


def device_steps(
    graph: LayerGraph, sides: Sequence[str], default: str, device: str
) -> Tuple[List[Step], int]:
    """(steps, input bytes per sample) of `graph` on `device`; `sides[i]`: where `top[i]` runs."""
    residence: Dict[str, set] = {}
    for position, index in enumerate(graph.top):
        for key in graph.produced(index) + graph.consumed(index):
            residence.setdefault(key, set()).add(sides[position])
    here = {key: (size if device in residence.get(key, {default}) else 0)
            for key, size in graph.sizes.items()}
    inputs = sum(here.get(key, 0) for key in dict.fromkeys(graph.input_keys))
    cuts = graph.cuts(graph.top, here)
    steps = []
    for position, index in enumerate(graph.top):
        produced = sum(here[key] for key in graph.produced(index))
        working = graph.working(index) if sides[position] == device else produced
        steps.append(Step(produced, working, cuts[position]))
    return steps, inputs
