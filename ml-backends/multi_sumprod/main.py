"""Element-wise sum and product of two float32 tensors, using the multi-tensor framing.

stdin holds one framed tensor per input, in textproto order ("a", then "b"):
a header line "<dtype> d0,d1,...\\n" followed by the raw little-endian bytes.
The output file holds one framed tensor per output ("sum", then "prod").
"""
import math
import os
import struct
import sys


def float32(x):
    """``x`` as float32 arithmetic would give it: infinity past the largest float32 (struct refuses those)."""
    try:
        struct.pack("<f", x)
    except OverflowError:
        return math.copysign(math.inf, x)
    return x


def read_frame(stream):
    dtype, dims = stream.readline().decode("utf-8").split(" ")
    shape = [int(d) for d in dims.strip().split(",")]
    count = 1
    for d in shape:
        count *= d
    values = struct.unpack("<%df" % count, stream.read(4 * count))
    return shape, values


def write_frame(stream, shape, values):
    stream.write(("float32 %s\n" % ",".join(str(d) for d in shape)).encode("utf-8"))
    stream.write(struct.pack("<%df" % len(values), *(float32(v) for v in values)))


shape, a = read_frame(sys.stdin.buffer)
_, b = read_frame(sys.stdin.buffer)
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    write_frame(out, shape, [x + y for x, y in zip(a, b)])
    write_frame(out, shape, [x * y for x, y in zip(a, b)])
