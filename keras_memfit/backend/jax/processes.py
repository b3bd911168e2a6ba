"""Several JAX processes (multi-controller JAX): the agreement between them, local copies, sums.

MemFit's steps hold no collective where memory can run out (docs/distributed.md): local copies
of the state, then an agreement (`agree`), then one sum (`all_sum`). The coordination service's
client is JAX private API, read only in `_client`.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import types
from typing import Any, Dict, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_memfit.backend.base import ProcessFailed

logger = logging.getLogger("keras_memfit")

TESTED_JAX = "0.10.2"
TIMEOUT_ENV = "KERAS_MEMFIT_PROCESS_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
_PREFIX = "keras_memfit"
_POLL_MS = 1000  # a wait on a peer's key checks its failure key this often


def multi_process() -> bool:
    """Whether this is one of several JAX processes (`jax.distributed`)."""
    return jax.process_count() > 1


def timeout_s() -> float:
    """Seconds a process waits for its peers in an agreement (`KERAS_MEMFIT_PROCESS_TIMEOUT`)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"{TIMEOUT_ENV} must be a positive number of seconds; received {raw!r}. "
            f"Unset it for the default ({DEFAULT_TIMEOUT_S:.0f} s)."
        )
    return value


def _client() -> Any:
    try:
        from jax._src import distributed
        client = distributed.global_state.client
    except (ImportError, AttributeError) as err:
        raise RuntimeError(
            "keras_memfit under several JAX processes needs the coordination service's "
            f"client (jax._src.distributed.global_state.client, tested with jax {TESTED_JAX}); "
            f"jax {jax.__version__} has none ({err!r}). Use jax {TESTED_JAX}, or one process."
        ) from err
    if client is None:
        raise RuntimeError(
            "keras_memfit found several JAX processes but no coordination service client: "
            "initialize them with keras.distribution.initialize(...) (jax.distributed)."
        )
    return client


# The rounds of agreement of this process (the same sequence on every process).
_AGREEMENT = types.SimpleNamespace(round=0, failed_posted=False)


def _agreement_key(round_: int, process: int) -> str:
    return f"{_PREFIX}/agree/{round_}/{process}"


def _failure_key(process: int) -> str:
    return f"{_PREFIX}/failed/{process}"


def post_failure(exc: BaseException) -> None:
    """Tell the other processes that this one failed with `exc` (once; never raises)."""
    if isinstance(exc, ProcessFailed) or _AGREEMENT.failed_posted or not multi_process():
        return
    _AGREEMENT.failed_posted = True
    try:
        text = repr(exc)
        text = text if len(text) <= 2000 else text[:2000] + "..."
        _client().key_value_set(_failure_key(jax.process_index()), text)
    except Exception as err:  # noqa: BLE001 - the original error matters, not this one
        logger.warning("could not tell the other JAX processes of this failure: %r", err)


def _wait_for(client: Any, round_: int, process: int, deadline: float, what: str) -> str:
    count = jax.process_count()
    while True:
        try:
            failure = client.key_value_try_get(_failure_key(process))
        except Exception:  # noqa: BLE001 - not found
            failure = None
        if failure is not None:
            raise ProcessFailed(
                f"process {process} of {count} failed: {failure} (this is process "
                f"{jax.process_index()}, stopping with it, during {what})"
            )
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProcessFailed(
                f"process {process} of {count} did not reach keras_memfit's agreement "
                f"within {timeout_s():.0f} s (during {what}): it died, hangs, or is much "
                f"slower; this is process {jax.process_index()}. Raise {TIMEOUT_ENV} if it "
                "is only slow (the first steps compile)."
            )
        try:
            return client.blocking_key_value_get(
                _agreement_key(round_, process), int(min(left * 1000, _POLL_MS)) or 1)
        except Exception as err:  # noqa: BLE001 - a timeout: poll again
            if "DEADLINE" not in str(err).upper() and "TIME" not in str(err).upper():
                raise


def agree(rows: int, what: str) -> List[int]:
    """Post this process's `rows`, wait (bounded) for every process's; their rows by index.

    Every process calls it in the same sequence; `what` names it in errors.

    Raises:
        ProcessFailed: A process posted a failure, or did not post in time.
    """
    client = _client()
    me, round_ = jax.process_index(), _AGREEMENT.round
    client.key_value_set(_agreement_key(round_, me), str(int(rows)))
    deadline = time.monotonic() + timeout_s()
    out = [int(rows if process == me else _wait_for(client, round_, process, deadline, what))
           for process in range(jax.process_count())]
    _AGREEMENT.round = round_ + 1
    if round_ > 0:  # every peer posted this round: each has read the last one
        try:
            client.key_value_delete(_agreement_key(round_ - 1, me))
        except Exception as err:  # noqa: BLE001 - a key left over costs a few bytes
            logger.debug("could not delete an agreement key: %r", err)
    return out


# ------------------------------------------------------------- arrays
def _is_global(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and not leaf.is_fully_addressable


def local_devices() -> List[Any]:
    """This process's devices of the distribution's mesh, in its order (else JAX's local ones)."""
    mesh = keras.distribution.distribution().device_mesh.backend_mesh  # every caller: DataParallel
    return list(mesh.local_devices) or list(jax.local_devices())


LOCAL_AXIS = "local"  # the axis of `local_mesh()`


def local_mesh() -> jax.sharding.Mesh:
    """A one-axis mesh of `local_devices()`: a program over it involves no other process."""
    return jax.sharding.Mesh(np.array(local_devices()), (LOCAL_AXIS,))


def local_sharding(mesh: jax.sharding.Mesh, rows: bool) -> jax.sharding.NamedSharding:
    """Over `mesh`: the leading axis laid out along `LOCAL_AXIS` (`rows`), or replicated."""
    spec = (LOCAL_AXIS,) if rows else ()
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _parts(array: Any) -> Dict[Any, Any]:
    """Device -> the array's data there (`addressable_shards` raises for one device a process)."""
    try:
        return {shard.device: shard.data for shard in array.addressable_shards}
    except ValueError:
        if len(array.sharding.addressable_devices) != 1:
            raise
        data = array.addressable_data(0)
        (device,) = data.devices()
        return {device: data}


def local(tree: Any) -> Any:
    """`tree` with every replicated global array replaced by its copy on the first local device."""
    device = local_devices()[0]

    def one(leaf: Any) -> Any:
        if not _is_global(leaf):
            return leaf
        data = leaf.addressable_data(0)  # replicated: every local copy is the same
        return data if device in data.devices() else jax.device_put(data, device)

    return jax.tree_util.tree_map(one, tree)


def replicated_locally(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """`tree` replicated over `mesh`, reusing each local device's copy of a global array."""
    sharding = local_sharding(mesh, rows=False)

    def one(leaf: Any) -> Any:
        if not _is_global(leaf):
            return jax.device_put(leaf, sharding)
        parts = _parts(leaf)
        arrays = [parts[device] for device in mesh.devices.flat]
        return jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)

    return jax.tree_util.tree_map(one, tree)


def per_device(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Each array of `tree` as one copy per device of `mesh`, stacked: row `i`, device `i`'s."""
    copies = replicated_locally(tree, mesh)
    sharding = local_sharding(mesh, rows=True)

    def one(leaf: Any) -> Any:
        parts = _parts(leaf)
        arrays = [parts[device][None] for device in mesh.devices.flat]
        return jax.make_array_from_single_device_arrays(
            (len(arrays),) + tuple(leaf.shape), sharding, arrays)

    return jax.tree_util.tree_map(one, copies)


def zeros_per_device(shape: Tuple[int, ...], dtype: Any, mesh: jax.sharding.Mesh) -> Any:
    """Zeros of `shape` on every device of `mesh`, stacked as `per_device` stacks."""
    size = int(mesh.devices.size)
    return jnp.zeros((size,) + tuple(shape), dtype, device=local_sharding(mesh, rows=True))


def map_per_device(fn: Any, stacked: Any, *others: Any) -> Any:
    """`fn(i, row, *other_rows)` on device `i`'s row of `per_device` arrays, on that device."""
    devices = [shard.device for shard in sorted(stacked.addressable_shards,
                                                key=lambda s: s.index[0].start or 0)]
    arrays = [_parts(a) for a in (stacked,) + others]
    rows = [fn(i, *(parts[device] for parts in arrays)) for i, device in enumerate(devices)]
    return jax.make_array_from_single_device_arrays(stacked.shape, stacked.sharding, rows)


def first_row(stacked: Any) -> Any:
    """The first device's row of a `per_device` array, without its leading axis."""
    first = min(stacked.addressable_shards, key=lambda s: s.index[0].start or 0)
    return first.data[0]


def local_rows(tree: Any) -> Any:
    """A batch laid out over every process, as this process's rows (NumPy) in global order."""

    def one(leaf: Any) -> Any:
        if not _is_global(leaf):
            return leaf
        blocks: Dict[int, Any] = {}  # first row -> data; replicated over local devices: once
        for shard in leaf.addressable_shards:
            blocks.setdefault(shard.index[0].start or 0, shard.data)
        parts = [np.asarray(blocks[start]) for start in sorted(blocks)]
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    return jax.tree_util.tree_map(one, tree)


def as_global(values: Sequence[Any], like: Sequence[Any]) -> List[Any]:
    """Local `values` (the same on every process) as global arrays laid out as `like`."""

    def one(value: Any, ref: Any) -> Any:
        if not _is_global(ref):
            return value
        arrays = [jax.device_put(value, device) for device in ref.sharding.addressable_devices]
        return jax.make_array_from_single_device_arrays(ref.shape, ref.sharding, arrays)

    return [one(value, ref) for value, ref in zip(values, like)]


@functools.lru_cache(maxsize=None)
def _sum_program(shardings: Tuple[Any, ...]) -> Any:
    return jax.jit(
        lambda stacked: [x.sum(axis=0) for x in stacked], out_shardings=list(shardings)
    )


def all_sum(values: Sequence[Any], like: Sequence[Any]) -> List[Any]:
    """The sum over the processes of each local array of `values` (`like`'s shape, or a
    `per_device` array of it), laid out as `like`."""
    if not values:
        return []
    mesh = like[0].sharding.mesh
    stacked_sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))
    first = local_devices()[0]
    stacked = []
    for value, ref in zip(values, like):
        value = value if isinstance(value, jax.Array) else jnp.asarray(value)
        shape = tuple(ref.shape)
        shards = []
        if tuple(value.shape) == shape:
            for device in stacked_sharding.addressable_devices:
                part = value if device == first else jnp.zeros_like(value)
                shards.append(jax.device_put(part[None], device))
        elif tuple(value.shape[1:]) == shape:
            parts = _parts(value)
            for device in stacked_sharding.addressable_devices:
                if device not in parts or parts[device].shape[0] != 1:
                    raise ValueError(
                        f"all_sum takes one row per local device; received an array of "
                        f"shape {tuple(value.shape)} with no single row on {device}")
                shards.append(parts[device])
        else:
            raise ValueError(
                f"all_sum takes arrays of shape {shape} or one row per local device of it; "
                f"received shape {tuple(value.shape)}")
        stacked.append(jax.make_array_from_single_device_arrays(
            (mesh.devices.size,) + shape, stacked_sharding, shards))
    return _sum_program(tuple(ref.sharding for ref in like))(stacked)


def is_data_parallel() -> bool:
    """Whether the active distribution is `keras.distribution.DataParallel`."""
    return isinstance(keras.distribution.distribution(), keras.distribution.DataParallel)
