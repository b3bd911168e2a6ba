"""The applications' errors: each carries the one line the user is shown."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """Work in the child process failed, in one line; `stderr`: the child's ("" if raised here)."""

    def __init__(self, message: str, stderr: str = "") -> None:
        super().__init__(message)
        self.stderr = stderr


class PredictError(WorkerError):
    """`keras-memfit predict` or `report` cannot go on (a bad model, input or output)."""


def one_line(err: BaseException) -> str:
    """The first line of `err`'s message (else its type's name), at most 300 characters."""
    text = str(getattr(err, "message", None) or err).strip()
    line = " ".join(text.splitlines()[0].split()) if text else type(err).__name__
    return line if len(line) <= 300 else line[:297] + "..."
