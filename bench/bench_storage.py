"""Weights from object storage: nereid's parallel ranged GETs vs one sequential GET, and the local loaders.

    python bench/bench_storage.py [--size-mib 1024] [--repeat 3]

1. **moto** (the S3 API the tests use, on 127.0.0.1): one safetensors file of
   ``--size-mib`` MiB, read (a) by nereid's streaming loader, the path a bundle
   in ``s3://`` takes (header by ranged GET, then parallel ranged GETs straight
   into preallocated arrays), and (b) by one sequential GET of the whole object
   streamed into a preallocated buffer. moto serves each ranged GET by reading
   the *whole* object and slicing it (``moto/s3/responses.py``), so a range
   costs it as much as the full GET: its ranged reads are bounded by that, and
   the loader runs against it with large chunks and few in flight
   (``--moto-chunk-mib``, ``--moto-concurrency``) to stay within memory.
2. **range server**: the same comparison against a loopback HTTP server that
   serves a range in O(range) (``os.sendfile`` of the file; obstore's
   HTTPStore), with nereid's defaults (16 MiB chunks, 32 in flight); once
   unthrottled and once with each connection capped at ``--per-connection-mib``
   MiB/s, as object stores cap a connection (S3: about 100 MB/s), which is what
   parallel ranges are for. The cap is an emulation and is labelled so.
3. **local**: nereid's pread loader vs ``safetensors.numpy.load_file`` on the
   same file, warm page cache.
4. **small files**: a python model folder of ``--small-files`` files (a
   vendored package) fetched into an empty cache from moto, each GET answered
   after ``--get-latency-ms`` (an emulated first-byte latency of a remote
   store, labelled so): nereid's fetches, FETCH_CONCURRENCY at a time, vs the
   same code one at a time.

Each row is the median of ``--repeat`` runs, measured side by side in one run.
Bytes are checked equal between the two reads of each pair.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_weights import make_file  # noqa: E402  (bench/ on the path, as when run as a script)

from nereid.backends.xla.remote import RemoteBundle  # noqa: E402
from nereid.backends.xla.safetensors import load_weights  # noqa: E402
from nereid.backends.xla.weights import resolve_weights  # noqa: E402
from nereid.storage import RangeRead, RemoteFolder, RemoteObject, StoreURL, read_ranges  # noqa: E402

MIB = 1 << 20


def timed(function: Callable[[], object], repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def sequential_get(store, key: str, size: int) -> np.ndarray:
    """One GET of the whole object, streamed into a preallocated buffer."""
    import obstore

    buffer = np.empty(size, np.uint8)
    offset = 0
    for chunk in obstore.get(store, key).stream(min_chunk_size=8 * MIB):
        view = np.frombuffer(chunk, np.uint8)
        buffer[offset:offset + len(view)] = view
        offset += len(view)
    assert offset == size, (offset, size)
    return buffer


def flat(arrays: list[tuple[str, np.ndarray]]) -> bytes:
    return b"".join(a.tobytes() for _, a in arrays)


# -- 1. moto ------------------------------------------------------------------------------------------------------

def bench_moto(path: Path, size: int, repeat: int, chunk: int, concurrency: int,
               scratch: Path) -> list[tuple[str, float, float]]:
    import obstore

    from moto_s3 import BUCKET, start_server

    state, server, thread = start_server()
    try:
        for key, value in state.env().items():
            os.environ[key] = value
        key = "bench/model/weights.safetensors"
        # Uploaded in 64 MiB parts: moto refuses one 1 GiB PUT body slowly.
        with open(path, "rb") as f:
            obstore.put(state.store, key, f, chunk_size=64 * MIB)
        meta = obstore.head(state.store, key)
        folder = Path(tempfile.mkdtemp(prefix="folder-", dir=scratch))
        remote = RemoteFolder(f"s3://{BUCKET}/bench/model", {},
                              {"weights.safetensors": RemoteObject(key, size, meta["e_tag"])})
        bundle = RemoteBundle(folder, remote, retries=0)

        def streamed() -> list[tuple[str, np.ndarray]]:
            weight_set = resolve_weights(bundle)
            return bundle.read_weights(weight_set, chunk_bytes=chunk, concurrency=concurrency)

        parallel_s, arrays = timed(streamed, repeat)
        sequential_s, whole = timed(lambda: sequential_get(state.store, key, size), repeat)
        header = resolve_weights(bundle).weights[0].header
        assert flat(arrays) == whole[header.data_start:].tobytes(), "the two reads disagree"
        del arrays, whole
        return [(f"moto: nereid ranged GETs ({chunk // MIB} MiB x {concurrency} in flight)", parallel_s, size),
                ("moto: one sequential GET", sequential_s, size)]
    finally:
        server.shutdown()
        thread.join(5)


# -- 2. a range server that serves ranges in O(range) ---------------------------------------------------------------

class _RangeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: Path
    per_connection_bytes_s: float | None = None

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def _serve(self, send_body: bool) -> None:
        path = self.root / self.path.lstrip("/")
        size = path.stat().st_size
        match = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
        start, end = (int(match.group(1)), int(match.group(2) or size - 1)) if match else (0, size - 1)
        end = min(end, size - 1)
        self.send_response(206 if match else 200)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", '"bench"')
        self.send_header("Last-Modified", "Mon, 30 Nov 2026 00:00:00 GMT")
        if match:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if not send_body:
            return
        self.wfile.flush()
        with open(path, "rb") as f:
            offset, remaining = start, end - start + 1
            started = time.perf_counter()
            while remaining:
                step = min(remaining, MIB)
                sent = os.sendfile(self.connection.fileno(), f.fileno(), offset, step)
                offset, remaining = offset + sent, remaining - sent
                if self.per_connection_bytes_s:  # emulate an object store's per-connection cap
                    due = (offset - start) / self.per_connection_bytes_s - (time.perf_counter() - started)
                    if due > 0:
                        time.sleep(due)


def bench_range_server(path: Path, size: int, repeat: int, cap_mib_s: float | None) -> list[tuple[str, float, float]]:
    from obstore.store import HTTPStore

    handler = type("Handler", (_RangeHandler,), {"root": path.parent,
                                                 "per_connection_bytes_s": cap_mib_s * MIB if cap_mib_s else None})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        store = HTTPStore.from_url(f"http://127.0.0.1:{server.server_port}/", client_options={"allow_http": True})
        buffer = np.empty(size, np.uint8)
        view = memoryview(buffer)
        chunk, concurrency = 16 * MIB, 32  # nereid's defaults
        reads = [RangeRead(path.name, o, (view[o:o + chunk],), "bench") for o in range(0, size, chunk)]
        location = StoreURL("s3", "bench")  # only names the reads in messages

        parallel_s, _ = timed(lambda: read_ranges(store, location, reads, concurrency=concurrency, retries=0), repeat)
        parallel = buffer.copy()
        sequential_s, whole = timed(lambda: sequential_get(store, path.name, size), repeat)
        assert parallel.tobytes() == whole.tobytes(), "the two reads disagree"
        label = f"capped at {cap_mib_s:g} MiB/s per connection (emulated)" if cap_mib_s else "unthrottled"
        return [(f"range server, {label}: nereid ranged GETs (16 MiB x 32)", parallel_s, size),
                (f"range server, {label}: one sequential GET", sequential_s, size)]
    finally:
        server.shutdown()
        thread.join(5)


# -- 3. local loaders -----------------------------------------------------------------------------------------------

def bench_local(path: Path, size: int, repeat: int) -> list[tuple[str, float, float]]:
    import safetensors.numpy

    load_weights(path)  # warm the page cache
    nereid_s, ours = timed(lambda: load_weights(path), repeat)
    library_s, theirs = timed(lambda: safetensors.numpy.load_file(str(path)), repeat)
    assert all(np.array_equal(a, theirs[n]) for n, a in ours), "the two loaders disagree"
    return [("local: nereid pread loader (8 threads, 16 MiB chunks)", nereid_s, size),
            ("local: safetensors.numpy.load_file", library_s, size)]


# -- 4. small files -------------------------------------------------------------------------------------------------

def bench_small_files(count: int, latency_s: float, repeat: int, scratch: Path) -> list[tuple[str, float, float]]:
    import obstore

    from moto_s3 import BUCKET, start_server
    from nereid.storage import mirror, parse_store_url

    state, server, _ = start_server()
    try:
        for key, value in state.env().items():
            os.environ[key] = value
        files = {f"pkg/mod{i}.py": f"VALUE = {i}\n".encode() * 50 for i in range(count)}
        files["main.py"] = b"import pkg\n"
        for relative, data in files.items():
            obstore.put(state.store, f"small/model/{relative}", data)
        state.get_latency_s = latency_s
        location = parse_store_url(f"s3://{BUCKET}/small")

        def fetch(concurrency: int) -> Callable[[], object]:
            def run() -> object:
                mirror.FETCH_CONCURRENCY = concurrency
                # (Its lock file lands beside the folder: in scratch too.)
                return mirror.materialize(location, "model", Path(tempfile.mkdtemp(prefix="mirror-", dir=scratch)))
            return run

        default = mirror.FETCH_CONCURRENCY
        try:
            parallel_s, result = timed(fetch(default), repeat)
            sequential_s, _ = timed(fetch(1), repeat)
        finally:
            mirror.FETCH_CONCURRENCY = default
        assert set(result.fetched) == set(files), "not every file was fetched"
        size = sum(map(len, files.values()))
        label = f"{count + 1} files, {latency_s * 1000:g} ms per GET (emulated)"
        return [(f"small files: nereid, {default} at a time ({label})", parallel_s, size),
                (f"small files: one at a time ({label})", sequential_s, size)]
    finally:
        server.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--moto-chunk-mib", type=int, default=128)
    parser.add_argument("--moto-concurrency", type=int, default=4)
    parser.add_argument("--per-connection-mib", type=float, default=100.0)
    parser.add_argument("--small-files", type=int, default=200)
    parser.add_argument("--get-latency-ms", type=float, default=20.0)
    parser.add_argument("--skip", nargs="*", default=[], choices=["moto", "range", "capped", "local", "small"])
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="nereid-bench-storage-"))
    path = folder / "weights.safetensors"
    size = make_file(path, args.size_mib, args.tensors)
    rows: list[tuple[str, float, float]] = []
    try:
        if "local" not in args.skip:
            rows += bench_local(path, size, args.repeat)
        if "range" not in args.skip:
            rows += bench_range_server(path, size, args.repeat, None)
        if "capped" not in args.skip:
            rows += bench_range_server(path, size, args.repeat, args.per_connection_mib)
        if "moto" not in args.skip:
            rows += bench_moto(path, size, args.repeat, args.moto_chunk_mib * MIB, args.moto_concurrency, folder)
        if "small" not in args.skip:
            rows += bench_small_files(args.small_files, args.get_latency_ms / 1000, args.repeat, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the weights file, the bundle folder, the mirrors
    print(f"\n{size / MIB:.0f} MiB, {args.tensors} tensors, median of {args.repeat}")
    print(f"{'what':<84} {'seconds':>8} {'MiB/s':>8}")
    for label, seconds, nbytes in rows:
        print(f"{label:<84} {seconds:8.3f} {nbytes / MIB / seconds:8.1f}")
    print()
    for first, second in zip(rows[0::2], rows[1::2]):
        print(f"{first[0].split(':')[0]}: {first[0].split(': ', 1)[1]} is {second[1] / first[1]:.2f}x "
              f"the speed of {second[0].split(': ', 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
