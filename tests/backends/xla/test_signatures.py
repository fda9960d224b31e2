"""From manifest tensors to the core's signature: the batch mode, the dims clients see, where an axis goes."""

from __future__ import annotations

import pytest

from nereid.backends.xla.manifest import Dim, DimKind, ManifestTensor
from nereid.backends.xla.signatures import BatchMode, batch_mode, build_signature, client_axis, client_dims
from nereid.dtypes import DType
from nereid.signature import ModelSignature, TensorSpec

BATCH = Dim(DimKind.BATCH, letter="n")
VARIABLE = Dim(DimKind.VARIABLE, letter="t")


def fixed(size: int, letter: str) -> Dim:
    return Dim(DimKind.FIXED, size, letter)


def tensor(name: str, *manifest_order: Dim, dtype: DType = DType.FP32) -> ManifestTensor:
    """A tensor whose axes are given as the manifest lists them (column-major: batch axis last, usually)."""
    return ManifestTensor(name, dtype, tuple(manifest_order))


IMAGE = tensor("image", fixed(3, "c"), fixed(5, "w"), fixed(4, "h"), BATCH)  # "cwhn": row-major [n, 4, 5, 3]
LOGITS = tensor("logits", fixed(10, "k"), BATCH)                             # "kn": [n, 10]
CHANNELS_FIRST = tensor("planes", fixed(5, "w"), BATCH, fixed(3, "c"))      # "wnc": [3, n, 5]
TOTAL = tensor("total", fixed(10, "k"))                                      # "k": [10], no batch axis
TOKENS = tensor("tokens", VARIABLE, BATCH, dtype=DType.INT64)                # "tn": [n, -1]


@pytest.mark.parametrize("inputs, outputs, batched, mode", [
    ((IMAGE,), (LOGITS,), False, BatchMode.NONE),
    ((IMAGE, TOKENS), (LOGITS,), True, BatchMode.LEADING),
    ((IMAGE,), (CHANNELS_FIRST,), True, BatchMode.MOVED),
    ((IMAGE, CHANNELS_FIRST), (TOTAL,), True, BatchMode.EXACT),
    ((IMAGE,), (TOTAL,), True, BatchMode.EXACT),
    ((TOTAL,), (LOGITS,), True, BatchMode.EXACT),  # only outputs batched: the smallest size runs
    ((), (LOGITS,), True, BatchMode.EXACT),  # (the XLA read hunt: no inputs was LEADING, every request refused)
], ids=["not-batched", "all-leading", "one-moved", "moved-and-unbatched", "one-unbatched", "only-outputs",
        "no-inputs"])
def test_the_batch_mode_of_a_model_s_tensors(inputs, outputs, batched, mode) -> None:
    assert batch_mode(inputs, outputs, batched) is mode


def test_only_leading_and_moved_batches_are_coalesced() -> None:
    assert [m for m in BatchMode if m.coalesces] == [BatchMode.LEADING, BatchMode.MOVED]


def test_a_leading_batch_is_left_out_of_the_dims_and_the_largest_size_is_the_max_batch_size() -> None:
    signature = build_signature((IMAGE, TOKENS), (LOGITS,), BatchMode.LEADING, 32)
    assert signature == ModelSignature((TensorSpec("image", DType.FP32, (4, 5, 3)),
                                        TensorSpec("tokens", DType.INT64, (-1,))),
                                       (TensorSpec("logits", DType.FP32, (10,)),), 32)


def test_a_moved_batch_is_left_out_wherever_it_stands_so_clients_see_it_leading() -> None:
    assert client_dims(CHANNELS_FIRST) == (fixed(3, "c"), fixed(5, "w"))
    signature = build_signature((CHANNELS_FIRST,), (LOGITS,), BatchMode.MOVED, 8)
    assert signature.inputs == (TensorSpec("planes", DType.FP32, (3, 5)),) and signature.max_batch_size == 8


def test_an_exact_batch_shows_the_whole_row_major_shape_and_no_max_batch_size() -> None:
    """Some tensor has no batch axis: the batch must be a compiled size, and the core must not pad to one."""
    signature = build_signature((IMAGE,), (LOGITS, TOTAL), BatchMode.EXACT, 8)
    assert signature == ModelSignature((TensorSpec("image", DType.FP32, (-1, 4, 5, 3)),),
                                       (TensorSpec("logits", DType.FP32, (-1, 10)),
                                        TensorSpec("total", DType.FP32, (10,))), 0)


def test_an_unbatched_tensor_keeps_all_its_dims() -> None:
    assert client_dims(TOTAL) == (fixed(10, "k"),)
    assert build_signature((TOTAL,), (TOTAL,), BatchMode.NONE, 8).inputs == (TensorSpec("total", DType.FP32, (10,)),)


@pytest.mark.parametrize("program_axis, batch_axis, wire_axis", [
    (0, 1, 1), (0, 2, 1), (1, 2, 2), (2, 1, 2), (3, 1, 3),
])
def test_a_program_axis_before_the_batch_shifts_by_one_on_the_wire_and_one_after_it_stays(
        program_axis, batch_axis, wire_axis) -> None:
    assert client_axis(program_axis, batch_axis) == wire_axis
