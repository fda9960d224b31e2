"""Unit tests of the subprocess contract's framed tensors (backends/subprocess/framing.py).

Frames are written by ``encode_frame`` and read back by ``read_header`` +
``read_body`` both from memory and from real files (the server reads model
outputs from a file), so the round trip is checked the way the backends use it.
"""

from __future__ import annotations

import io
import os
import struct
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from nereid.backends.subprocess.dtype_names import contract_name, dtype_of_contract_name
from nereid.backends.subprocess.framing import MAX_HEADER_BYTES, MAX_RANK, encode_frame, read_body, read_header
from nereid.dtypes import DType
from nereid.errors import ModelFailure
from nereid.tensors import NamedTensor

WHERE = "model 'm': output 'out'"


def sample(dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
    """Distinct, exactly representable values of ``dtype`` in ``shape``."""
    count = int(np.prod(shape))
    if dtype is DType.BYTES:
        # Empty, binary (NUL, 0xff), and multi-byte UTF-8 elements.
        pool = [b"", b"a", b"\x00\xff\x00", "h\u00e9llo".encode(), b"x" * 300]
        return np.array([pool[i % len(pool)] for i in range(count)], dtype=object).reshape(shape)
    if dtype is DType.BOOL:
        return (np.arange(count) % 3 == 0).reshape(shape)
    values = np.arange(count) - (count // 2 if np.issubdtype(dtype.numpy, np.signedinteger) else 0)
    if dtype in (DType.FP16, DType.FP32, DType.FP64, DType.BF16, DType.F8E5M2, DType.F8E4M3):
        values = values * 0.5
    return values.astype(dtype.numpy).reshape(shape)


def read_frame(data: bytes, where: str = WHERE) -> tuple[DType, tuple[int, ...], np.ndarray]:
    stream = io.BytesIO(data)
    dtype, shape = read_header(stream, where)
    return dtype, shape, read_body(stream, dtype, shape, where)


def failure(data: bytes) -> str:
    """The ModelFailure message of reading one frame from ``data``."""
    with pytest.raises(ModelFailure) as caught:
        read_frame(data)
    message = str(caught.value)
    assert message.startswith(WHERE), message  # always says whose output is broken
    return message


# -- round trips -----------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(2, 3), (5,), (1, 1, 2), ()], ids=str)
def test_round_trip_every_dtype(dtype: DType, shape: tuple[int, ...]) -> None:
    array = sample(dtype, shape)
    frame = encode_frame(NamedTensor("t", dtype, array))
    header = frame.split(b"\n", 1)[0].decode()
    assert header == f"{contract_name(dtype)} {','.join(str(d) for d in shape)}"
    read_dtype, read_shape, read_array = read_frame(frame)
    assert read_dtype is dtype
    assert read_shape == shape
    assert read_array.shape == shape
    if dtype is DType.BYTES:
        assert read_array.dtype == object
        assert read_array.tolist() == array.tolist()
    else:
        assert read_array.dtype == dtype.numpy
        # Compare bit patterns: exact for every type, NaN-safe for the float ones.
        assert read_array.tobytes() == array.tobytes()


def test_bfloat16_body_is_raw_little_endian_bits() -> None:
    array = np.array([1.0, -2.0, 0.5], dtype=ml_dtypes.bfloat16)
    frame = encode_frame(NamedTensor("t", DType.BF16, array))
    # bfloat16 1.0 is 0x3f80, -2.0 is 0xc000, 0.5 is 0x3f00; little-endian on the wire.
    assert frame == b"bfloat16 3\n" + b"\x80\x3f" + b"\x00\xc0" + b"\x00\x3f"
    _, _, back = read_frame(frame)
    assert back.astype(np.float32).tolist() == [1.0, -2.0, 0.5]


def test_bytes_body_is_kserve_length_prefixed() -> None:
    array = np.array([b"ab", b"", b"\xffz"], dtype=object)
    frame = encode_frame(NamedTensor("t", DType.BYTES, array))
    assert frame == (b"bytes 3\n" + struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0)
                     + struct.pack("<I", 2) + b"\xffz")
    # str elements are sent as their UTF-8 encoding
    text = np.array(["\u00e9t\u00e9"], dtype=object)
    assert read_frame(encode_frame(NamedTensor("t", DType.BYTES, text)))[2].tolist() == ["\u00e9t\u00e9".encode()]


def test_big_endian_arrays_are_written_little_endian() -> None:
    array = np.array([1, 256], dtype=">i4")
    frame = encode_frame(NamedTensor("t", DType.INT32, array))
    assert frame == b"int32 2\n" + struct.pack("<2i", 1, 256)
    assert read_frame(frame)[2].tolist() == [1, 256]


def test_several_frames_in_one_real_file(tmp_path: Path) -> None:
    """How multi-output models reply: frames back to back, read in order from a file."""
    tensors = [NamedTensor("a", DType.FP32, sample(DType.FP32, (2, 4))),
               NamedTensor("b", DType.BYTES, sample(DType.BYTES, (2, 3))),
               NamedTensor("c", DType.BF16, sample(DType.BF16, (2,))),
               NamedTensor("d", DType.BOOL, sample(DType.BOOL, (1, 3)))]
    path = tmp_path / "output"
    path.write_bytes(b"".join(encode_frame(t) for t in tensors))
    with open(path, "rb") as stream:
        for tensor in tensors:
            dtype, shape = read_header(stream, WHERE)
            assert (dtype, shape) == (tensor.dtype, tensor.shape)
            data = read_body(stream, dtype, shape, WHERE)
            assert data.tolist() == tensor.data.tolist()
        assert stream.read() == b""  # every byte consumed, nothing more


def test_zero_sized_tensor_round_trips() -> None:
    for dtype in (DType.FP32, DType.BYTES):
        array = np.empty((0, 4), dtype=dtype.numpy)
        dtype_read, shape, back = read_frame(encode_frame(NamedTensor("t", dtype, array)))
        assert (dtype_read, shape, back.shape) == (dtype, (0, 4), (0, 4))


@pytest.mark.parametrize("header", [b"float32 0,1402,3551724,463065592\n", b"bytes 0,4294967296,4294967296\n"])
def test_empty_tensor_with_unrepresentable_dims_is_a_model_failure(header: bytes) -> None:
    # No body bytes are needed for a zero-sized tensor, so only the dims' product can be refused
    # (found by the property test in tests/core/test_properties.py).
    with pytest.raises(ModelFailure, match="too large for any array"):
        read_frame(header)


def test_largest_representable_empty_tensor_is_read() -> None:
    dtype, shape, array = read_frame(f"int8 0,{2 ** 63 - 1}\n".encode())  # numpy's exact limit
    assert (dtype, shape, array.size) == (DType.INT8, (0, 2 ** 63 - 1), 0)


def test_scalar_header_without_dims() -> None:
    # "<dtype> \n": one space, then no dimensions, declares a scalar (rank 0).
    dtype, shape, array = read_frame(b"int16 \n" + struct.pack("<h", -7))
    assert (dtype, shape, array.tolist()) == (DType.INT16, (), -7)


def test_a_header_without_its_space_is_refused_even_for_a_scalar() -> None:
    """Found by a bug hunt: "float32\\n" passed for a scalar, where the README says the header has one space."""
    assert failure(b"float32\n" + struct.pack("<f", 1.5)) == (
        f"{WHERE}: header 'float32' has no space after its dtype (expected \"<dtype> d0,d1,...\", with one space; "
        "a scalar's is \"<dtype> \", nothing after the space)")


def test_header_at_the_size_limit_is_accepted() -> None:
    # Leading zeros pad the header to exactly MAX_HEADER_BYTES before its newline.
    prefix = b"uint8 "
    dims = b"0" * (MAX_HEADER_BYTES - len(prefix) - 1) + b"3"
    header = prefix + dims
    assert len(header) == MAX_HEADER_BYTES
    dtype, shape, array = read_frame(header + b"\n" + b"\x01\x02\x03")
    assert (dtype, shape, array.tolist()) == (DType.UINT8, (3,), [1, 2, 3])


# -- malformed headers -----------------------------------------------------

def test_empty_output_has_no_header() -> None:
    assert "no header line" in failure(b"")


def test_header_without_newline() -> None:
    message = failure(b"float32 4")
    assert "not terminated by a newline" in message and "float32 4" in message


@pytest.mark.parametrize("size", [MAX_HEADER_BYTES + 1, 5000, 100_000])
def test_oversized_header(size: int) -> None:
    message = failure(b"f" * size + b"\nmore")
    assert f"header line longer than {MAX_HEADER_BYTES} bytes" in message
    assert len(message) < 300  # the junk itself is not echoed back


def test_oversized_header_does_not_read_past_the_limit() -> None:
    stream = io.BytesIO(b"9" * 100_000)
    with pytest.raises(ModelFailure):
        read_header(stream, WHERE)
    assert stream.tell() <= MAX_HEADER_BYTES + 1


@pytest.mark.parametrize("header", [b"float32 4 4\n", b" 4\n", b"\n", b"float32  4\n"], ids=repr)
def test_malformed_header(header: bytes) -> None:
    message = failure(header + b"\x00" * 16)
    assert "malformed header" in message


def test_bad_dtype() -> None:
    message = failure(b"float33 4\n" + b"\x00" * 16)
    assert "unknown dtype 'float33'" in message
    assert "float32" in message  # lists the valid names


def test_kserve_spelling_is_not_a_contract_dtype() -> None:
    assert "unknown dtype 'FP32'" in failure(b"FP32 4\n" + b"\x00" * 16)


@pytest.mark.parametrize("written, meant", [("FP32", "float32"), ("BF16", "bfloat16"), ("TYPE_INT8", "int8"),
                                            ("STRING", "bytes"), ("FLOAT64", "float64")])
def test_a_header_in_another_spelling_is_told_the_contract_s(written: str, meant: str) -> None:
    """Defect (the new user's hunt): a header written with the textproto's datatype (`FP32 4`) got only "unknown
    dtype 'FP32'" and the list, not which of its names is the one meant."""
    message = failure(f"{written} 4\n".encode() + b"\x00" * 16)
    assert message.endswith(f"; write {meant} (the subprocess contract's name for "
                            f"{dtype_of_contract_name(meant).kserve}, as in the README's dtype table)"), message


# Python's int() would take '+4', '0_4', ' 4', '4\r' and non-ASCII digits; the contract's are ASCII.
@pytest.mark.parametrize("dims", [b"4,x", b"4,", b"1.5", b",4", b"4;4", b"-1", b"2,-4", b"-0,-3", b"+4", b"0_4",
                                  b"4\r", b"4\t", "\u0664".encode()], ids=repr)
def test_dims_that_are_not_ascii_decimal_integers(dims: bytes) -> None:
    assert "dimensions must be comma-separated decimal integers" in failure(b"float32 " + dims + b"\n" + b"\x00" * 64)


def test_rank_over_limit() -> None:
    # rank MAX_RANK itself is fine, one more is refused
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":  # (numpy 1 holds 32 dims at most)
        assert MAX_RANK == 33  # (found by a bug hunt: 32, a batching model declaring 32 dims could not answer)
    dtype, shape, _ = read_frame(b"float32 " + b",".join([b"1"] * MAX_RANK) + b"\n" + b"\x00" * 4)
    assert len(shape) == MAX_RANK
    assert "bad shape" in failure(b"float32 " + b",".join([b"1"] * (MAX_RANK + 1)) + b"\n" + b"\x00" * 4)


def test_header_not_utf8() -> None:
    assert "not UTF-8" in failure(b"\xff\xfe 4\n")


# -- truncated bodies ------------------------------------------------------

def test_truncated_body() -> None:
    message = failure(b"float32 2,2\n" + b"\x00" * 8)
    assert "header promises 16 bytes of float32 [2, 2], file holds 8" in message


def test_missing_body() -> None:
    assert "file holds 0" in failure(b"int64 3\n")


def test_truncated_bytes_length_prefix() -> None:
    message = failure(b"bytes 2\n" + struct.pack("<I", 1) + b"a" + b"\x01\x00")
    assert "BYTES data ends before element 1 of 2" in message


def test_truncated_bytes_element() -> None:
    message = failure(b"bytes 1\n" + struct.pack("<I", 10) + b"abc")
    assert "BYTES element 0 is truncated" in message


def test_huge_declared_shape_with_little_data(tmp_path: Path) -> None:
    """A header promising gigabytes fails on the data actually there, without allocating it."""
    path = tmp_path / "output"
    path.write_bytes(b"float32 10000000000\n" + b"\x00" * 8)
    with open(path, "rb") as stream, pytest.raises(ModelFailure) as caught:
        dtype, shape = read_header(stream, WHERE)
        read_body(stream, dtype, shape, WHERE)
    assert "header promises 40000000000 bytes" in str(caught.value)
    assert "file holds 8" in str(caught.value)


def test_huge_bytes_count_or_length_with_little_data(tmp_path: Path) -> None:
    path = tmp_path / "output"
    path.write_bytes(b"bytes 4000000\n" + struct.pack("<I", 1) + b"a")
    with open(path, "rb") as stream, pytest.raises(ModelFailure) as caught:
        dtype, shape = read_header(stream, WHERE)
        read_body(stream, dtype, shape, WHERE)
    assert "BYTES data ends before element 1 of 4000000" in str(caught.value)
    path.write_bytes(b"bytes 1\n" + struct.pack("<I", 0xFFFFFFF0) + b"abc")
    with open(path, "rb") as stream, pytest.raises(ModelFailure) as caught:
        dtype, shape = read_header(stream, WHERE)
        read_body(stream, dtype, shape, WHERE)
    assert "BYTES element 0 is truncated" in str(caught.value)


def test_huge_declared_shape_on_a_pipe() -> None:
    """A stream that cannot say how much it holds is read in bounded chunks."""
    read_fd, write_fd = os.pipe()
    with open(write_fd, "wb") as writer:
        writer.write(b"float64 10000000000\n" + b"\x00" * 24)
    with open(read_fd, "rb") as stream:
        assert not stream.seekable()
        with pytest.raises(ModelFailure) as caught:
            dtype, shape = read_header(stream, WHERE)
            read_body(stream, dtype, shape, WHERE)
    assert "header promises 80000000000 bytes of float64 [10000000000], file holds 24" in str(caught.value)


def test_large_frame_on_a_pipe_round_trips() -> None:
    """A frame bigger than one read chunk arrives whole through a non-seekable stream."""
    array = np.arange(5 * 1024 * 1024, dtype=np.float32)  # 20 MiB
    frame = encode_frame(NamedTensor("t", DType.FP32, array))
    read_fd, write_fd = os.pipe()

    def write() -> None:
        with open(write_fd, "wb") as writer:
            writer.write(frame)

    writer_thread = threading.Thread(target=write)
    writer_thread.start()
    with open(read_fd, "rb") as stream:
        dtype, shape = read_header(stream, WHERE)
        back = read_body(stream, dtype, shape, WHERE)
    writer_thread.join()
    assert shape == array.shape and np.array_equal(back, array)


# -- a bound on the data ------------------------------------------------------

BOUND = "a response can carry at most N bytes"


def test_a_header_promising_more_than_the_bound_fails_before_its_data_is_read() -> None:
    """Defect: a header alone decided how much the server read: a 2.2 GB frame (a sparse file, free for the model)
    was read whole into memory, to be refused by grpcio afterwards without the model named."""
    header = b"float32 2,3\n"
    stream = io.BytesIO(header + bytes(24))
    dtype, shape = read_header(stream, WHERE)
    with pytest.raises(ModelFailure) as caught:
        read_body(stream, dtype, shape, WHERE, 23, BOUND)
    assert str(caught.value) == f"{WHERE}: header promises 24 bytes of float32 [2, 3]; {BOUND}"
    assert stream.tell() == len(header)  # none of the data read
    assert read_body(stream, dtype, shape, WHERE, 24, BOUND).shape == (2, 3)  # the bound itself fits


def test_a_header_past_the_bound_over_a_short_file_says_both() -> None:
    stream = io.BytesIO(b"float64 1000000000\n" + bytes(8))
    dtype, shape = read_header(stream, WHERE)
    with pytest.raises(ModelFailure) as caught:
        read_body(stream, dtype, shape, WHERE, 1 << 20, BOUND)
    assert str(caught.value) == (f"{WHERE}: header promises 8000000000 bytes of float64 [1000000000], file holds 8; "
                                 f"{BOUND}")


def test_bytes_data_past_the_bound_fails_before_the_element_that_passes_it_is_read() -> None:
    prefixes_alone = io.BytesIO(b"bytes 7\n")
    dtype, shape = read_header(prefixes_alone, WHERE)
    with pytest.raises(ModelFailure) as caught:
        read_body(prefixes_alone, dtype, shape, WHERE, 27, BOUND)
    assert str(caught.value) == f"{WHERE}: header promises 7 BYTES elements, at least 28 bytes; {BOUND}"
    frame = encode_frame(NamedTensor.from_array("t", np.array([b"abc", b"defgh"], dtype=object)))
    stream = io.BytesIO(frame)
    dtype, shape = read_header(stream, WHERE)
    with pytest.raises(ModelFailure) as caught:
        read_body(stream, dtype, shape, WHERE, 15, BOUND)
    assert str(caught.value) == f"{WHERE}: BYTES element 1 of 2 (5 bytes) brings the data to 16 bytes; {BOUND}"
    assert stream.tell() == len(frame) - 5  # element 1's length read, never its bytes
    stream.seek(len(frame) - 16)
    assert read_body(stream, dtype, shape, WHERE, 16, BOUND).tolist() == [b"abc", b"defgh"]  # exactly the bound


def test_outputs_past_what_the_server_can_hold_or_the_file_holds_are_refused_before_reading(tmp_path, monkeypatch):
    """Found by the warm-start hunt: a model could write `bytes N` and truncate the file up (a sparse file) to make
    the server build half a billion BYTES objects (tens of GiB); a fixed-size body promising more than its file
    held was read whole (2.3 GB) before it was refused."""
    from nereid.backends.subprocess import framing

    with pytest.raises(ModelFailure, match=r"header promises 16777217 BYTES elements, past the 16777216 this run's "
                                           r"output may hold \(16777216 per row it was given"):
        read_body(io.BytesIO(b""), DType.BYTES, (framing.MAX_BYTES_ELEMENTS + 1,), "output 'o'", 1 << 31, "")
    # A batch's run holds as many per row (two such requests batched failed together: the hunt of the cap), up to
    # MAX_BYTES_ROWS rows (32 one-number rows let a model answer half a billion: the hunt of that).
    assert framing.MAX_BYTES_ROWS == 4
    with pytest.raises(ModelFailure, match=r"BYTES data ends before element 0 of 16777218"):
        read_body(io.BytesIO(b""), DType.BYTES, (2, (framing.MAX_BYTES_ELEMENTS + 1) // 2 + 1), "output 'o'",
                  1 << 31, "", max_elements=2 * framing.MAX_BYTES_ELEMENTS)
    sparse = tmp_path / "out.bin"
    with open(sparse, "wb") as f:
        f.truncate(64 << 20)  # 64 MiB of (sparse) zeros, 8 bytes short of 16M+2 FP32
    monkeypatch.setattr(framing, "_read_at_most", lambda stream, size: pytest.fail("read before it was refused"))
    with open(sparse, "rb") as f, pytest.raises(ModelFailure, match=r"file holds 67108864"):
        read_body(f, DType.FP32, ((16 << 20) + 2,), "output 'o'", 1 << 31, "")
