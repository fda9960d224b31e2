"""Dynamic repository: a renamed bundle against a cold load, and latency while a model reloads.

    python3 bench/bench_watch.py [--weights-mib 512] [--seconds 8] [--threads 4]

Exports a bundle whose one weight is ``--weights-mib`` MiB (the program reads a
slice of it, so that requests stay cheap and the weights dominate a load),
serves it from a real ``nereid serve`` process with ``server.watch: true``, and
measures, in one run:

1. the cold load of the bundle (nereid's own load time, from /metrics), against
   the time from ``os.rename`` of its folder to READY under the new name (the
   settle time included: what a user waits for);
2. the p50/p99 latency of a steady load (``--threads`` clients sending back to
   back for ``--seconds``) without a reload, and the same load while the
   model's folder is edited and the model reloads (zero-downtime swap); every
   failed request is counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from common import free_port, print_table, running

SETTLE_MS = 1000  # the default: a rename does not wait for it


def slice_add(x, w):
    return x + w[0, :16]


def export(root: Path, weights_mib: int) -> Path:
    from nereid.backends.xla.export import export_bundle

    columns = 16384
    rows = max(1, weights_mib * (1 << 20) // (columns * 4))
    weight = np.zeros((rows, columns), np.float32)
    weight[0, :16] = np.arange(16, dtype=np.float32)
    return export_bundle(slice_add, [np.zeros((1, 16), np.float32)], {"w": weight}, directory=root / "big",
                         batch_sizes=[1, 8], input_names=["x"], provenance=False)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {key: float(value) for key, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


def wait_ready(client, model: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.is_model_ready(model):
                return
        except Exception:  # noqa: BLE001 - NOT_FOUND until the watcher has seen the folder
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{model} not ready")
        time.sleep(0.005)


def steady_load(url: str, model: str, threads: int, seconds: float, during=None) -> tuple[list[float], int]:
    """Latencies (ms) of back-to-back requests from ``threads`` clients, and the failure count."""
    import tritonclient.grpc as triton

    latencies: list[float] = []
    failures = [0]
    stop = time.monotonic() + seconds
    x = np.ones((1, 16), np.float32)

    def client_loop() -> None:
        client = triton.InferenceServerClient(url)
        tensor = triton.InferInput("x", [1, 16], "FP32")
        tensor.set_data_from_numpy(x)
        while time.monotonic() < stop:
            started = time.perf_counter()
            try:
                client.infer(model, [tensor])
                latencies.append((time.perf_counter() - started) * 1e3)
            except Exception:  # noqa: BLE001 - counted, never expected
                failures[0] += 1
        client.close()

    workers = [threading.Thread(target=client_loop) for _ in range(threads)]
    for worker in workers:
        worker.start()
    if during is not None:
        time.sleep(seconds / 4)
        during()
    for worker in workers:
        worker.join()
    return latencies, failures[0]


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def main() -> None:
    import tritonclient.grpc as triton

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights-mib", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ml-backends"
        root.mkdir()
        bundle = export(root, args.weights_mib)
        config = Path(tmp) / "nereid.yaml"
        metrics_port = free_port()
        config.write_text(f'server:\n  ml_backends_path: "ml-backends"\n  metrics_addr: "127.0.0.1:{metrics_port}"\n'
                          f"  http_addr: \"\"\n  watch: true\n  watch_settle_ms: {SETTLE_MS}\n")
        address = f"127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "nereid.cli", "serve", "--config", str(config), "--bind", address,
                "--log-level", "WARNING"]
        with running(argv, address, lambda a: wait_ready(triton.InferenceServerClient(a), "big")):
            client = triton.InferenceServerClient(address)
            cold_s = scrape(metrics_port)['nereid_model_load_duration_seconds_sum{model="big"}']
            started = time.perf_counter()
            os.rename(bundle, root / "big2")
            wait_ready(client, "big2")
            rename_s = time.perf_counter() - started
            steady, steady_failures = steady_load(address, "big2", args.threads, args.seconds)

            def edit() -> None:  # the same bytes written again: a new mtime, so a reload
                manifest = root / "big2" / "manifest.yaml"
                manifest.write_bytes(manifest.read_bytes())

            reloading, reload_failures = steady_load(address, "big2", args.threads, args.seconds, during=edit)
            version = scrape(metrics_port)['nereid_model_version{model="big2"}']
            client.close()
    print_table(f"Rename of a bundle with {args.weights_mib} MiB of weights (settle {SETTLE_MS} ms)",
                ["cold load s", "rename to READY s", "rename / cold"], [[cold_s, rename_s, rename_s / cold_s]])
    print_table(f"Steady load, {args.threads} clients, {args.seconds:g} s each (ms)",
                ["", "requests", "failed", "p50", "p99"],
                [["no reload", len(steady), steady_failures, statistics.median(steady), p99(steady)],
                 [f"reload (version {version:g})", len(reloading), reload_failures, statistics.median(reloading),
                  p99(reloading)]])
    print(f"\np99 while reloading / p99 steady: {p99(reloading) / p99(steady):.2f}x")


if __name__ == "__main__":
    main()
