"""DeviceTransfer: host arrays onto the CPU device, straight through jaxlib or through jax.device_put."""

from __future__ import annotations

import numpy as np
import pytest

from nereid.backends.xla.dtype_tokens import TOKENS
from nereid.dtypes import DType

from nereid.backends.xla import transfer as transfer_module
from nereid.backends.xla.transfer import DeviceTransfer

# Every element type a bundle may declare, BYTES aside (no device type).
DEVICE_DTYPES = [dtype.numpy for dtype in TOKENS if dtype is not DType.BYTES]


def cpu_device():
    from jax.extend import backend

    return backend.get_backend("cpu").local_devices()[0]


def sample_arrays() -> list[np.ndarray]:
    """One array per device dtype, with the awkward shapes beside them: empty, scalar, strided."""
    rng = np.random.default_rng(3)
    arrays = [rng.integers(-100, 100, (2, 3)).astype(dtype) if dtype.kind != "b" else rng.random((2, 3)) > 0.5
              for dtype in DEVICE_DTYPES]
    arrays += [np.zeros((0, 4), np.float32), np.array(2.5, np.float64), np.arange(10, dtype=np.int64)[::3],
               np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min]), np.array([2**64 - 1], np.uint64)]
    return arrays


def assert_round_trip(transfer: DeviceTransfer) -> None:
    arrays = sample_arrays()
    on_device = transfer.put(arrays)
    assert len(on_device) == len(arrays)
    for array, result in zip(arrays, on_device):
        assert result.dtype == array.dtype, "64-bit and low-precision types must arrive as they are"
        assert result.shape == array.shape
        np.testing.assert_array_equal(np.asarray(result), array)
        assert next(iter(result.devices())) == transfer.device


def test_this_jaxlib_takes_the_direct_path_and_every_dtype_arrives_unchanged() -> None:
    transfer = DeviceTransfer(cpu_device())
    assert transfer.direct, "jaxlib's batched_device_put should be usable with the pinned jaxlib"
    assert_round_trip(transfer)


def test_a_jaxlib_without_the_direct_call_falls_back_to_device_put(monkeypatch) -> None:
    def moved():
        raise AttributeError("module 'jaxlib.xla_client' has no attribute 'batched_device_put'")

    # What a future jaxlib that moved the call looks like to this module (jax itself still needs it here).
    monkeypatch.setattr(transfer_module, "jaxlib_batched_device_put", moved)
    transfer = DeviceTransfer(cpu_device())
    assert not transfer.direct
    assert_round_trip(transfer)


def test_a_direct_call_that_changed_its_arguments_falls_back_too(monkeypatch) -> None:
    def changed(*args, **kwargs):
        raise TypeError("batched_device_put(): incompatible function arguments")

    monkeypatch.setattr(transfer_module, "jaxlib_batched_device_put", lambda: changed)
    transfer = DeviceTransfer(cpu_device())
    assert not transfer.direct
    assert_round_trip(transfer)


@pytest.mark.parametrize("direct", [True, False])
def test_both_paths_give_arrays_a_program_accepts(direct, monkeypatch) -> None:
    import jax
    import jax.numpy as jnp
    if not direct:
        monkeypatch.setattr(transfer_module, "jaxlib_batched_device_put", lambda: None)  # not callable
    transfer = DeviceTransfer(cpu_device())
    assert transfer.direct is direct
    x, w = transfer.put([np.ones((2, 3), np.float32), np.full((3, 4), 2, np.float32)])
    np.testing.assert_array_equal(np.asarray(jax.jit(jnp.matmul)(x, w)), np.full((2, 4), 6, np.float32))


def test_many_shapes_keep_arriving_past_the_cache_of_abstract_values() -> None:
    transfer = DeviceTransfer(cpu_device())
    arrays = [np.full((rows,), rows, np.int32) for rows in range(1, transfer_module._MAX_AVALS + 40)]
    for array, result in zip(arrays, transfer.put(arrays)):
        np.testing.assert_array_equal(np.asarray(result), array)


@pytest.mark.parametrize("direct", [True, False])
def test_weights_read_from_a_file_become_cpu_device_buffers_without_a_copy(direct, tmp_path) -> None:
    # The device buffer is the host array itself, so a loaded bundle's weights are in memory once, not twice
    # until jax's next garbage collection (which an idle server never reaches).
    from nereid.backends.xla.safetensors import load_weights, write_safetensors

    rng = np.random.default_rng(4)
    write_safetensors(tmp_path / "w.safetensors", [("large", rng.standard_normal((512, 512)).astype(np.float32)),
                                                   ("small", np.arange(12, dtype=np.int64).reshape(3, 4))])
    arrays = [array for _, array in load_weights(tmp_path / "w.safetensors")]
    transfer = DeviceTransfer(cpu_device(), direct=direct)
    for array, result in zip(arrays, transfer.put(arrays)):
        assert result.unsafe_buffer_pointer() == array.ctypes.data, f"{array.shape} {array.dtype} was copied"
        np.testing.assert_array_equal(np.asarray(result), array)
