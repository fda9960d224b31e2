"""Shared bench plumbing: free ports, servers in subprocesses, perf_analyzer runs, tables."""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import grpc

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

# Settings that let perf_analyzer report on a noisy, shared 2-core machine.
PERF_ANALYZER_FLAGS = ("--measurement-interval", "2000", "--max-trials", "3", "--stability-percentage", "999")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perf_analyzer_command() -> tuple[str, dict[str, str]]:
    """The perf_analyzer binary and an environment in which it starts."""
    binary = Path(sys.executable).with_name("perf_analyzer")
    if not binary.exists():
        found = shutil.which("perf_analyzer")
        if found is None:
            sys.exit("perf_analyzer not found: python3 -m pip install -e '.[bench]' (see bench/README.md)")
        binary = Path(found)
    env = dict(os.environ)
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is not None and spec.submodule_search_locations:
        lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
        env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    return str(binary), env


def wait_until_serving(address: str, timeout_s: float = 120) -> None:
    """Block until a gRPC server answers at ``address`` (any RPC reply counts)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        while True:
            try:
                grpc.channel_ready_future(channel).result(timeout=1)
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nothing serving at {address}")


@contextlib.contextmanager
def running(argv: Sequence[str], address: str, ready_check=None, grpc_check: bool = True) -> Iterator[subprocess.Popen]:
    """Run a server process for the duration of the block; it is stopped with SIGTERM.

    It is ready once a gRPC server answers at ``address`` (unless ``grpc_check`` is False) and
    ``ready_check(address)`` returns.
    """
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    try:
        if grpc_check:
            wait_until_serving(address)
        if ready_check is not None:
            ready_check(address)
        yield process
    except BaseException:
        log.seek(0)
        sys.stderr.write(log.read().decode(errors="replace")[-4000:])
        raise
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def wait_model_ready(address: str, model: str, timeout_s: float = 300) -> None:
    """Block until ``model`` is READY on a nereid server."""
    import tritonclient.grpc as triton

    client = triton.InferenceServerClient(address)
    deadline = time.monotonic() + timeout_s
    while not client.is_model_ready(model):
        if time.monotonic() > deadline:
            raise TimeoutError(f"model {model} not ready at {address}")
        time.sleep(0.2)
    client.close()


def perf_analyzer(address: str, model: str, concurrency: int, *extra: str, protocol: str = "grpc") -> dict[str, float]:
    """One perf_analyzer run (``protocol`` grpc or http); returns throughput (infer/s) and latencies (µs)."""
    binary, env = perf_analyzer_command()
    with tempfile.TemporaryDirectory() as out:
        report = Path(out) / "report.csv"
        argv = [binary, "-m", model, "-u", address, "-i", protocol, "--concurrency-range", str(concurrency),
                *PERF_ANALYZER_FLAGS, "-f", str(report), *extra]
        try:
            completed = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"perf_analyzer did not finish within 600 s against {address} ({' '.join(extra)}): "
                               "a server that leaves requests unanswered (an RPC it lacks?)") from None
        if completed.returncode != 0 or not report.exists():
            raise RuntimeError(f"perf_analyzer failed ({completed.returncode}):\n{completed.stdout[-3000:]}"
                               f"\n{completed.stderr[-3000:]}")
        row = next(csv.DictReader(report.open()))
    return {"throughput": float(row["Inferences/Second"]), "p50_us": float(row["p50 latency"]),
            "p99_us": float(row["p99 latency"])}


def models_args(description: str) -> argparse.Namespace:
    """``--concurrency`` (one or more, default 1 and 16) and ``--repeat`` (default 3), of a benchmark that
    compares models of one server at each concurrency."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeat", type=int, default=3, help="runs per model and concurrency; medians reported")
    return parser.parse_args()


def alternating_models(argv: Sequence[str], address: str, models: Sequence[str], concurrencies: Sequence[int],
                       repeat: int, measure: Callable[[subprocess.Popen, str, int], dict[str, float]] | None = None,
                       ) -> dict[tuple[str, int], dict[str, float]]:
    """Start the server ``argv`` (on ``address``), wait for every model READY, and measure each model at each
    concurrency ``repeat`` times, the models alternating; returns the medians of each figure by (model,
    concurrency). ``measure(server, model, concurrency)``: one run's figures (default: one perf_analyzer run)."""
    if measure is None:
        def measure(_server: subprocess.Popen, model: str, concurrency: int) -> dict[str, float]:
            return perf_analyzer(address, model, concurrency)

    def ready(a: str) -> None:
        for model in models:
            wait_model_ready(a, model)

    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    with running(argv, address, ready) as server:
        for concurrency in concurrencies:
            for _ in range(repeat):
                for model in models:
                    runs.setdefault((model, concurrency), []).append(measure(server, model, concurrency))
    return {key: {k: statistics.median(r[k] for r in results) for k in results[0]} for key, results in runs.items()}


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain aligned table."""
    cells = [list(map(str, header))] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for index, row in enumerate(cells):
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
        if index == 0:
            print("  ".join("-" * width for width in widths))
