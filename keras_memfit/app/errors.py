"""The applications' errors: each carries the one line the user is shown.

`WorkerError` is raised by the worker runner (`keras_memfit.app.worker`) and by
the work it runs; `PredictError` by `keras-memfit predict` and `report` for a
bad model, input or output file. Both reach the command line, which prints
`keras-memfit: error: MESSAGE` and exits 1.
"""

from __future__ import annotations

__all__ = ["PredictError", "WorkerError", "one_line"]


class WorkerError(RuntimeError):
    """Work in the child process failed; the message is one line for the user.

    Attributes:
        stderr: What the child process wrote to stderr ("" when the error was
            raised in this process), for callers that log more than one line.
    """

    def __init__(self, message: str, stderr: str = "") -> None:
        super().__init__(message)
        self.stderr = stderr


class PredictError(WorkerError):
    """`keras-memfit predict` (or `report`) cannot go on; the message is the one line shown.

    Raised in the parent (a bad file caught before TensorFlow starts) or in
    the child process, whose `WorkerError`s reach the parent unchanged.
    """


def one_line(err: BaseException) -> str:
    """The first line of an exception's message, at most 300 characters.

    Args:
        err: The exception.

    Returns:
        Its message's first line, whitespace collapsed; its type's name when
        it has no message.

    Example:
        >>> one_line(ValueError("bad\\nthings"))
        'bad'
    """
    text = str(getattr(err, "message", None) or err).strip()
    line = " ".join(text.splitlines()[0].split()) if text else type(err).__name__
    return line if len(line) <= 300 else line[:297] + "..."
