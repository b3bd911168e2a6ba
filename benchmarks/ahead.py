"""safe_predict's overhead on JAX with 0, 1 and 2 pieces started ahead (`runner.AHEAD`).

On JAX, `safe_predict` starts up to `AHEAD` pieces before it waits for the
oldest (`keras_memfit.planning.runner`), as Keras's own loops overlap their
steps. This script measures what that pays: for each number of pieces ahead
it times `safe_predict` against `model.predict` on the same arrays, at the
same batch size, in interleaved pairs (`benchmarks.overhead.interleave`), and
reports the ratio of medians with its 95% bootstrap interval
(`benchmarks.common.Result`). With 0 ahead every piece is waited for as soon
as it started. Printed only; RESULTS.md is not written.

Usage:
    KERAS_BACKEND=jax python -m benchmarks.ahead
    KERAS_BACKEND=jax python -m benchmarks.ahead --samples 40000 --repeats 7
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

import numpy as np

from benchmarks.common import Result
from benchmarks.overhead import build, interleave, make_data

AHEADS = (0, 1, 2)


def measure(model_name: str, batch_size: int, samples: int, repeats: int,
            aheads: Sequence[int] = AHEADS) -> List[Result]:
    """One `Result` per number of pieces ahead (its `call` says how many).

    Args:
        model_name: A model of `benchmarks.overhead.MODELS`.
        batch_size: The batch size of both paths.
        samples: Rows per call.
        repeats: Timed pairs per number of pieces ahead.
        aheads: The numbers of pieces ahead to measure.
    """
    import keras

    from keras_memfit import safe_predict
    from keras_memfit.planning import runner

    keras.utils.clear_session()
    model = build(model_name)
    x, _ = make_data(model_name, samples)
    expected = model.predict(x, batch_size=batch_size, verbose=0)  # traces
    results = []
    kept = runner.AHEAD
    try:
        for ahead in aheads:
            runner.AHEAD = ahead
            got = safe_predict(model, x, batch_size=batch_size, verbose=0)  # warm-up
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
            keras_times, memfit_times = interleave(
                lambda: model.predict(x, batch_size=batch_size, verbose=0),
                lambda: safe_predict(model, x, batch_size=batch_size, verbose=0),
                repeats,
            )
            results.append(Result(model_name, f"predict, {ahead} ahead", batch_size, samples,
                                  repeats, keras_times, memfit_times))
    finally:
        runner.AHEAD = kept
    return results


def table(results: Sequence[Result]) -> str:
    """The results as a Markdown table (seconds per call, ratio, interval)."""
    lines = [
        "| Pieces started ahead | Keras s | safe_predict s | Ratio | 95% interval |",
        "|---|---|---|---|---|",
    ]
    for result in results:
        ahead = result.call.split(", ")[1].split()[0]
        lines.append(
            f"| {ahead} | {result.keras_median:.3f} | {result.memfit_median:.3f} | "
            f"{result.ratio:.3f} | {result.interval_text} |"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=("mlp", "digit_cnn"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=32 * 1000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    import keras

    if keras.backend.backend() != "jax":
        print("error: run with KERAS_BACKEND=jax", file=sys.stderr)
        return 2
    results = measure(args.model, args.batch_size, args.samples, args.repeats)
    print(f"{args.model}, batch {args.batch_size}, {args.samples} rows, "
          f"{args.repeats} interleaved pairs:")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
