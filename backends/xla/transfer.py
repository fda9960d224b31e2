"""Host arrays onto a model's device, once per execution.

``jax.device_put`` is the public way, but it walks jax's general machinery
(pytrees, sharding checks, the x64 context) for every call: 40 µs with warm
caches and 150-200 µs right after an execution has streamed a large model's
weights through them, more than a small bundle's whole program
(bench/bench_xla_transfer.py). jax itself ends in jaxlib's ``batched_device_put``
for a numpy array on one device; :class:`DeviceTransfer` calls that directly,
with the same arguments jax passes (committed, no forced copy, 64-bit kept), so
the resulting arrays are the ones ``device_put`` would have made.

That entry point is jaxlib's, not a stable API (like the PJRT client methods
this backend compiles with; pyproject.toml bounds jaxlib for that reason). So a
transfer first proves itself on a probe array at load, and falls back to
``jax.device_put`` with a debug line where the call is missing or has changed.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

# Shapes and dtypes whose jax abstract value is kept; a model serves one per compiled program input.
_MAX_AVALS = 256


class DeviceTransfer:
    """Copies numpy arrays to one PJRT device as jax arrays (64-bit dtypes kept)."""

    def __init__(self, device: Any, direct: bool = True) -> None:
        """``direct`` False: always through ``jax.device_put`` (to compare the two)."""
        self.device = device
        self._put_one: Callable[[np.ndarray], Any] | None = _direct_put(device) if direct else None

    @property
    def direct(self) -> bool:
        """True when transfers go straight to jaxlib (False: through ``jax.device_put``)."""
        return self._put_one is not None

    def put(self, arrays: Sequence[np.ndarray]) -> list[Any]:
        """The arrays on the device, in order."""
        if self._put_one is not None:
            return [self._put_one(array) for array in arrays]
        return _device_put(arrays, self.device)


def _device_put(arrays: Sequence[np.ndarray], device: Any) -> list[Any]:
    import jax

    # x64 only for this transfer: without it jax narrows 64-bit arrays to 32 bits.
    with jax.enable_x64(True):
        return jax.device_put(list(arrays), device)


def jaxlib_batched_device_put() -> Callable[..., Any]:
    """jaxlib's transfer entry point (AttributeError where a jaxlib no longer has it)."""
    from jaxlib import xla_client

    return xla_client.batched_device_put


def _direct_put(device: Any) -> Callable[[np.ndarray], Any] | None:
    """jaxlib's transfer bound to ``device``, or None where it does not work as jax's does."""
    try:
        from jax._src import core
        from jax.sharding import SingleDeviceSharding

        batched_device_put = jaxlib_batched_device_put()
        sharding = SingleDeviceSharding(device)
        avals: dict[tuple, Any] = {}

        def put_one(array: np.ndarray) -> Any:
            key = (array.shape, array.dtype)
            aval = avals.get(key)
            if aval is None:  # 4 µs to build; the compiled programs' static shapes make them few
                if len(avals) >= _MAX_AVALS:
                    avals.clear()
                aval = avals[key] = core.ShapedArray(array.shape, array.dtype)
            return batched_device_put(aval, sharding, [array], [device], True, False, enable_x64=True)

        probe = np.arange(-3, 3, dtype=np.int64).reshape(2, 3)
        result = put_one(probe)
        if result.dtype != probe.dtype or not np.array_equal(np.asarray(result), probe):
            raise TypeError(f"the probe came back as {result.dtype} {np.asarray(result).tolist()}")
    except Exception as err:  # a jaxlib whose internals moved: the public path still works
        log.debug("xla: transfers go through jax.device_put (jaxlib's batched_device_put: %s: %s)",
                  type(err).__name__, err)
        return None
    return put_one
