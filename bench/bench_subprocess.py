"""Subprocess backend: a main.py model at concurrency 16, dynamic batching on vs off.

One process per batch: with batching on, the requests that queue while a
process runs share the next one. Same model folder, same load (perf_analyzer),
only ``batching.enabled`` differs. Prints throughput side by side and the gain.

    python3 bench/bench_subprocess.py [--concurrency 16]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from common import REPO_ROOT, free_port, perf_analyzer, print_table, running, wait_model_ready

MODEL = "python_rowsum"  # the shipped example: [batch, 16] FP32 -> per-row sums, stdlib only


def config(root: Path, batching: bool, concurrency: int) -> Path:
    models = root / "ml-backends"
    shutil.copytree(REPO_ROOT / "ml-backends" / MODEL, models / MODEL)
    path = root / f"nereid-{'on' if batching else 'off'}.yaml"
    path.write_text(f'server:\n  ml_backends_path: ml-backends\n  metrics_addr: ""\n'
                    f"models:\n  - name: {MODEL}\n    queue_capacity: {4 * concurrency}\n"
                    f"    batching:\n      enabled: {'true' if batching else 'false'}\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    results = {}
    for batching in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            path = config(Path(tmp), batching, args.concurrency)
            address = f"127.0.0.1:{free_port()}"
            argv = [sys.executable, "-m", "nereid.cli", "serve", "--config", str(path), "--bind", address,
                    "--log-level", "WARNING"]
            with running(argv, address, lambda a: wait_model_ready(a, MODEL)):
                results[batching] = perf_analyzer(address, MODEL, args.concurrency)
    gain = results[True]["throughput"] / results[False]["throughput"]
    print_table(f"Subprocess model ({MODEL}, main.py) at concurrency {args.concurrency}",
                ["batching", "infer/s", "p50 us", "p99 us"],
                [[name, results[on]["throughput"], results[on]["p50_us"], results[on]["p99_us"]]
                 for name, on in (("off", False), ("on", True))])
    print(f"\nbatching on / off: {gain:.2f}x")


if __name__ == "__main__":
    main()
