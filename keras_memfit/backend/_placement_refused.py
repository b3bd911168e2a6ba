"""The placement functions of a backend that cannot keep layers on another device.

`keras_memfit.place` needs five functions of a backend's `devices` module
(`device_scope`, `move_variable`, `creating_on`, `call_on_device`,
`follow_variable_devices`). A backend without a clean way to place layers
(JAX: not implemented yet; torch: Keras runs every layer on its one device)
takes them from `PlacementRefused`, each raising `NotImplementedError` with
the backend's reason and what was asked.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NoReturn, Tuple


class PlacementRefused:
    """The five placement functions, each raising `NotImplementedError`.

    Args:
        message: The backend's reason, a format string with `{what}` (what
            was asked, e.g. "moving a variable to 'cpu:0'").

    Example:
        >>> device_scope, move_variable, creating_on, call_on_device, follow_variable_devices = (
        ...     PlacementRefused("place is not implemented here ({what})").functions())
        >>> move_variable(v, "cpu:0")  # raises NotImplementedError
    """

    def __init__(self, message: str) -> None:
        self._message = message

    def functions(self) -> Tuple[Callable, ...]:
        """`(device_scope, move_variable, creating_on, call_on_device, follow_variable_devices)`."""
        return (self.device_scope, self.move_variable, self.creating_on, self.call_on_device,
                self.follow_variable_devices)

    def _refuse(self, what: str) -> NoReturn:
        raise NotImplementedError(self._message.format(what=what))

    def device_scope(self, device: str) -> "contextlib.AbstractContextManager[Any]":
        self._refuse(f"device_scope({device!r})")

    def move_variable(self, variable: Any, device: str) -> bool:
        self._refuse(f"moving a variable to {device!r}")

    def creating_on(self, device: str, add_weight: Callable) -> Callable:
        self._refuse(f"creating weights on {device!r}")

    def call_on_device(self, device: str, call: Callable) -> Callable:
        self._refuse(f"pinning calls to {device!r}")

    def follow_variable_devices(self, optimizer: Any) -> None:
        self._refuse("placing optimizer slots")
