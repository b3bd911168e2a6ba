"""What a worker's work reports: the batch sizes it ran and what keras_memfit logged.

Shared by the demo and `keras-memfit predict` (and the benchmarks): the
`keras_memfit` logger's records caught while `safe_predict` runs
(`LogRecords`: the adaptations, and a WARNING per OOM paid), and the batch
sizes run, summarised (`usual_size`) and run-length encoded (`describe_sizes`).
Standard library only.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Sequence

__all__ = ["LogRecords", "describe_sizes", "usual_size"]

Reporter = Callable[[str], None]


def usual_size(sizes: Sequence[int]) -> int:
    """The batch size run most often (the largest on a tie); 0 for no batches.

    Args:
        sizes: The size of every batch, in order.

    Returns:
        The size most batches ran at (the probes and the last, clipped batch
        are smaller).

    Example:
        >>> usual_size([16, 64, 655, 655, 655, 410])
        655
    """
    return max(sorted(set(sizes), reverse=True), key=sizes.count) if sizes else 0


def describe_sizes(sizes: Sequence[int]) -> str:
    """Batch sizes run, consecutive equal sizes run-length encoded.

    Args:
        sizes: The size of every batch, in order.

    Returns:
        E.g. "16, 64, 755 x 36, 648"; "" for no batches.

    Example:
        >>> describe_sizes([16, 64, 655, 655, 655, 410])
        '16, 64, 655 x 3, 410'
    """
    parts: List[str] = []
    i = 0
    while i < len(sizes):
        j = i
        while j + 1 < len(sizes) and sizes[j + 1] == sizes[i]:
            j += 1
        count = j - i + 1
        parts.append(f"{sizes[i]} x {count}" if count > 1 else str(sizes[i]))
        i = j + 1
    return ", ".join(parts)


class LogRecords(logging.Handler):
    """Keeps the `keras_memfit` logger's messages, and shows them as they come.

    Attach it with `capture()` around the work; `messages` then holds every
    INFO-or-above message and `warnings` counts the WARNINGs (an OOM caught).

    Args:
        show: Called with "      [LEVEL] message" for each record, or None.

    Example:
        >>> records = LogRecords(None)
        >>> with records.capture():
        ...     safe_predict(model, x, batch_size=28000)
        >>> records.warnings  # OOMs paid
        1
    """

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

    def capture(self) -> "_Capture":
        """A context manager attaching this handler to the `keras_memfit` logger at INFO.

        Returns:
            The context manager.
        """
        return _Capture(self)


class _Capture:
    def __init__(self, handler: logging.Handler) -> None:
        self.handler = handler
        self.logger = logging.getLogger("keras_memfit")
        self.old_level = self.logger.level

    def __enter__(self) -> logging.Handler:
        self.old_level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)
        return self.handler

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.old_level)
