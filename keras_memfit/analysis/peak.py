"""The one estimate of a step's peak memory: `fixed + batch_size * per_sample`.

`estimate` is the formula, for the whole model or for the share of one
device; `device_steps` says what of the traced forward pass lives on one
device of a model whose variables span several (after `keras_memfit.place`).

- Inference: fixed = weights, plus optimizer slots when the optimizer is
  built (they stay on the device); per sample = the inputs (held by the
  caller throughout) plus the largest live set along the forward pass: for
  each top-level call, the tensors still needed after the previous one (the
  previous cut) plus its working bytes.
- Training: fixed = weights + slots + gradients (one per trainable weight) +
  `UPDATE_WORKING_COPIES` of the largest trainable weight (the optimizer
  update's temporaries); per sample = the inputs, every activation (all are
  kept for the backward pass), plus `BACKWARD_WORKING_COPIES` more of the
  largest one (the gradients flowing back through it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from keras_memfit.analysis.graph import LayerGraph

# Training keeps the layers' outputs for the backward pass; the backward pass
# itself holds about two more activations of the largest layer at a time (the
# gradient flowing in and the one flowing out).
BACKWARD_WORKING_COPIES = 2
# The optimizer's update computes a few weight-sized temporaries per variable
# (and densifies sparse gradients such as an Embedding's), one variable at a time.
UPDATE_WORKING_COPIES = 2


class Step(NamedTuple):
    """One top-level call as the estimate sees it (bytes per sample).

    Attributes:
        produced: What it and its sublayers produce (kept for the backward pass).
        working: What it holds at its busiest beyond the tensors it was given.
        cut: What is still alive after it.
    """

    produced: int
    working: int
    cut: int


class VariableBytes(NamedTuple):
    """One variable as the estimate sees it.

    Attributes:
        device: Where it lives, short form ("CPU:0"); "" when not created yet.
        nbytes: Bytes of its value.
        slot_bytes: Bytes of its optimizer slots (0 for a non-trainable one).
        trainable: Whether it gets a gradient and an update.
    """

    device: str
    nbytes: int
    slot_bytes: int
    trainable: bool


@dataclasses.dataclass
class DeviceMemory:
    """The peak estimate of a model, or of one device of a model whose variables span several.

    Attributes:
        device: The device ("CPU:0", "GPU:0").
        param_bytes: Bytes of the weights living there.
        slot_bytes: Bytes of the optimizer slots of those weights.
        fixed_bytes: The part of the device's estimated peak that does not
            grow with the batch.
        bytes_per_sample: The part of the device's estimated peak per sample.
    """

    device: str
    param_bytes: int
    slot_bytes: int
    fixed_bytes: int
    bytes_per_sample: int

    def peak_bytes_at(self, batch_size: int) -> int:
        """`fixed_bytes + batch_size * bytes_per_sample`."""
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
    """The peak estimate of one step (see the module docstring for the formula).

    Args:
        steps: The top-level calls in call order.
        variables: The variables counted (all, or those of one device).
        input_bytes: Bytes per sample of the model's inputs held there.
        training: A training step (else inference).
        slots_resident: Whether the optimizer's slots exist (built optimizer):
            they then count for inference too.
        device: The device estimated for (None: a model without variables).

    Returns:
        The `DeviceMemory`.
    """
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
    """The top-level steps and input bytes of `graph` as they land on `device`.

    `sides[i]` is the device top-level call `graph.top[i]` runs on. A tensor
    lives on the device of the call producing it and on that of every
    top-level call consuming it (a model input: on its consumers' devices, or
    on `default`). A call on `device` holds its full working set there; a call
    elsewhere holds only what it produces there.

    Returns:
        (steps, input bytes per sample on `device`).
    """
    residence: Dict[str, set] = {}
    for position, index in enumerate(graph.top):
        for key in graph.produced(index):
            residence.setdefault(key, set()).add(sides[position])
    for position, index in enumerate(graph.top):
        for key in graph.consumed(index):
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
