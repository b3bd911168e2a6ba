"""`safe_generate`: KerasHub's `CausalLM.generate` in batches that fit."""

from __future__ import annotations

import importlib.util
import inspect
import logging
from typing import Any, Dict, Hashable, Optional, Tuple

from keras_memfit._internal import batches as _batches
from keras_memfit._internal import validate as _validate
from keras_memfit.inference import generation as _generation
from keras_memfit.planning.planner import BatchPlanner
from keras_memfit.planning.runner import run_in_pieces

logger = logging.getLogger("keras_memfit")

_PHASE = "generate"


def safe_generate(
    causal_lm: Any,
    inputs: Any,
    max_length: Optional[int] = None,
    batch_size: Optional[int] = None,
    **generate_kwargs: Any,
) -> Any:
    """Drop-in for KerasHub's `causal_lm.generate` that feeds prompts in batches that fit.

    Takes and returns what `generate` does, on pieces of the prompts as large as memory
    allows. With a random sampler (KerasHub's default "top_k") the outputs depend on the
    batching; `sampler="greedy"` does not (docs/inference.md).

    Args:
        batch_size: Largest number of prompts per `generate` call; None: all that fit.
        **generate_kwargs: Passed to `generate` (`stop_token_ids`, `strip_prompt`).

    Returns:
        What `causal_lm.generate(inputs, max_length, **generate_kwargs)` returns: strings
        (one for a single prompt) with a preprocessor, else a dict of numpy arrays.

    Raises:
        ImportError: If keras-hub is not installed.
        TypeError: If `causal_lm` is not a KerasHub `CausalLM`, or `inputs` is of a type
            `generate` does not take.
        ValueError: If `max_length` or `batch_size` is not a positive int, a keyword is not
            one of `generate`'s, or `inputs` is empty.
        keras_memfit.OutOfMemoryError: If even one prompt does not fit.
    """
    if importlib.util.find_spec("keras_hub") is None:
        raise ImportError(
            "safe_generate runs KerasHub's CausalLM.generate, and keras-hub is not "
            "installed; install it with `pip install keras-hub` (or "
            "`pip install 'keras-memfit[hub]'`)"
        )
    import keras_hub

    if not isinstance(causal_lm, keras_hub.models.CausalLM):
        raise TypeError(
            "causal_lm must be a keras_hub.models.CausalLM (e.g. GPT2CausalLM, "
            f"GemmaCausalLM); received {type(causal_lm).__name__}: {causal_lm!r:.80}"
        )
    max_length = _validate.positive_int("max_length", max_length)
    batch_size = _validate.positive_int("batch_size", batch_size)
    accepted = inspect.signature(causal_lm.generate).parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = [] if open_ended else sorted(set(generate_kwargs) - set(accepted))
    if unknown or {"inputs", "max_length"} & set(generate_kwargs):
        raise ValueError(
            f"Arguments not recognized: {sorted(generate_kwargs)}. safe_generate takes "
            "causal_lm, inputs, max_length, batch_size and the keywords of "
            f"{type(causal_lm).__name__}.generate: "
            f"{[p for p in accepted if p not in ('inputs', 'max_length')]}"
        )
    chunks, scalar = _generation.prompt_chunks(inputs)

    def generate(x: Any) -> Any:
        return causal_lm.generate(
            _generation.to_generate_input(x), max_length=max_length, **generate_kwargs
        )

    outputs = []
    # What a compiled generate loop's shape depends on besides the rows.
    settings = (max_length, repr(sorted(generate_kwargs.items())))
    planners: Dict[Hashable, Tuple[BatchPlanner, _generation.ShapeKeeper]] = {}
    done = 0
    for chunk in chunks:
        signature = (_batches.signature(chunk[0]), settings)
        if signature not in planners:
            planners[signature] = (
                BatchPlanner(causal_lm, _PHASE, signature, batch_size),
                _generation.ShapeKeeper(causal_lm, signature),
            )
        planner, keeper = planners[signature]
        for piece in run_in_pieces(
            causal_lm, _PHASE, [chunk], lambda piece, keeper=keeper: keeper.run(piece[0], generate),
            requested=batch_size, planner=planner,
            detail="Each prompt runs to max_length tokens: use a shorter max_length.",
        ):
            outputs.append(piece.result)
            done += piece.rows
    logger.debug("safe_generate: %d prompts generated", done)
    return _generation.joined_outputs(outputs, scalar)
