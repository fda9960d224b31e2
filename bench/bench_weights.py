"""Weight-load throughput: nereid's pread loader vs ``cat FILE > /dev/null`` on the same file.

    python bench/bench_weights.py [--size-mib 1024] [--tensors 64] [--repeat 5]

Writes one safetensors file, then reads it alternately with ``cat`` and with
nereid's loader (``os.preadv`` into preallocated numpy arrays, parallel chunks,
and sequentially), warm (file in the page cache) and cold (the file's pages
evicted with ``posix_fadvise(DONTNEED)`` before each read; a best effort: the
storage may still cache). Prints the median of each and the ratio of nereid's
throughput to cat's. "reads only" repeats the loader's preads into arrays that
were allocated and touched beforehand, which isolates the reads from the cost of
faulting in fresh memory (cat reuses one small buffer and never pays it). The
file is removed afterwards.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from nereid.backends.xla.safetensors import (DEFAULT_READ_THREADS, read_header, read_into, read_tensors,
                                             write_safetensors)


def make_file(path: Path, size_mib: int, tensors: int) -> int:
    """A safetensors file of ``tensors`` float32 tensors totalling ``size_mib`` MiB; returns its size."""
    per_tensor = size_mib * 1024 * 1024 // 4 // tensors
    rng = np.random.default_rng(0)
    block = rng.standard_normal(per_tensor, dtype=np.float32)
    # One random block, rolled per tensor: cheap to make, and no two tensors alike.
    write_safetensors(path, ((f"layer{i}.weight", np.roll(block, i)) for i in range(tensors)))
    return path.stat().st_size


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (only this file; needs no privileges)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_cat(path: Path) -> None:
    with open(os.devnull, "wb") as sink:
        subprocess.run(["cat", str(path)], stdout=sink, check=True)


def run_nereid(path: Path, threads: int) -> None:
    arrays = read_tensors(read_header(path), threads=threads)
    assert arrays  # keep the arrays alive until the read is complete


class ReadsOnly:
    """The loader's reads into arrays allocated and touched once beforehand.

    It separates the cost of the reads from that of faulting in fresh memory,
    which cat (one small reused buffer) never pays.
    """

    def __init__(self, path: Path) -> None:
        self.header = read_header(path)
        self.arrays = [np.ones(e.shape, e.dtype.numpy) for e in self.header.tensors]

    def __call__(self, path: Path) -> None:
        read_into(self.header, self.arrays, threads=DEFAULT_READ_THREADS)


def timed(function: Callable[[], None]) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the file (default: a temp dir)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "weights.safetensors"
        size = make_file(path, args.size_mib, args.tensors)
        readers: list[tuple[str, Callable[[Path], None]]] = [
            ("cat FILE > /dev/null", run_cat),
            (f"nereid load, {DEFAULT_READ_THREADS} threads", lambda p: run_nereid(p, DEFAULT_READ_THREADS)),
            ("nereid load, 1 thread", lambda p: run_nereid(p, 1)),
            ("nereid reads only (*)", ReadsOnly(path)),
        ]
        results: dict[tuple[str, str], list[float]] = {}
        for case in ("warm", "cold"):
            if case == "warm":
                run_cat(path)  # bring it into the page cache once
            for _ in range(args.repeat):
                for name, reader in readers:  # interleaved, so drift hits every reader alike
                    if case == "cold":
                        evict(path)
                    results.setdefault((case, name), []).append(timed(lambda: reader(path)))
    gib = size / 2 ** 30
    print(f"weights file: {size / 2 ** 20:.0f} MiB, {args.tensors} float32 tensors; median of {args.repeat} runs; "
          f"{os.cpu_count()} CPUs")
    print(f"{'cache':<6} {'reader':<28} {'seconds':>9} {'GiB/s':>8} {'vs cat':>8}")
    for case in ("warm", "cold"):
        baseline = statistics.median(results[(case, readers[0][0])])
        for name, _ in readers:
            seconds = statistics.median(results[(case, name)])
            print(f"{case:<6} {name:<28} {seconds:>9.3f} {gib / seconds:>8.2f} {baseline / seconds:>7.2f}x")
    print("(*) the same preads into arrays allocated and touched beforehand: the load minus the cost of "
          "faulting in fresh memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
