"""What a worker's work reports: the batch sizes it ran and what keras_memfit logged."""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Callable, Iterator, List, Optional, Sequence

Reporter = Callable[[str], None]


def usual_size(sizes: Sequence[int]) -> int:
    """The batch size run most often (the largest on a tie); 0 for no batches."""
    return max(sorted(set(sizes), reverse=True), key=sizes.count) if sizes else 0


def describe_sizes(sizes: Sequence[int]) -> str:
    """Batch sizes run, consecutive equal sizes run-length encoded: "16, 64, 755 x 36, 648"."""
    runs = [(size, len(list(run))) for size, run in itertools.groupby(sizes)]
    return ", ".join(f"{size} x {count}" if count > 1 else str(size) for size, count in runs)


class LogRecords(logging.Handler):
    """Keeps (and `show`s) the `keras_memfit` logger's messages in `capture()`; counts WARNINGs."""

    def __init__(self, show: Optional[Reporter] = None) -> None:
        super().__init__(logging.INFO)
        self.messages: List[str] = []
        self.warnings = 0
        self.show = show

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if record.levelno >= logging.WARNING:
            self.warnings += 1
        if self.show is not None:
            self.show(f"      [{record.levelname}] {message}")

    @contextlib.contextmanager
    def capture(self) -> Iterator["LogRecords"]:
        """Attach this handler to the `keras_memfit` logger, at INFO, while the block runs."""
        logger = logging.getLogger("keras_memfit")
        old_level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.setLevel(old_level)


def batch_sizes(sizes: List[int]) -> Any:
    """A Keras callback that appends the rows of every predicted batch to `sizes`."""
    import keras

    class BatchSizes(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
            # Keras flattens nested logs and turns one-element arrays into floats: one row.
            value = next(iter((logs or {}).values()), None)
            sizes.append(int(value.shape[0]) if getattr(value, "ndim", 0) else 1)

    return BatchSizes()
