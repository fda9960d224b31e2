"""Batching gain: a memory-bound bundle served with dynamic batching on vs off,
next to the gain the compiled program itself shows between batch 1 and batch 16.

    python3 bench/bench_batching.py [--concurrency 16] [--seconds 3]

The bundle is one 2048x2048 float32 layer (16 MiB of weights read per call),
compiled for batch sizes 1, 4 and 16 by nereid.backends.xla.export. Direct: the loaded
bundle's ``infer`` called in a loop at batch 1 and at batch 16, in this process
(rows per second). Served: perf_analyzer at the given concurrency, one row per
request, against `nereid serve` with batching off and on. "On" is tuned as one
tunes Triton's dynamic batcher for such a model: the largest compiled size as
the preferred batch size, and a queue delay that lets the requests answered by
the previous batch come back in time to fill the next one (without it, 16
clients split into two alternating half batches, each padded to 16). The target
is a served gain of at least 80% of the direct gain.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import free_port, perf_analyzer, print_table, running, wait_model_ready

MODEL = "dense2048"
WIDTH = 2048
BATCH_SIZES = (1, 4, 16)


def layer(x, w):
    return x @ w


def export(models: Path) -> Path:
    from nereid.backends.xla.export import export_bundle

    weights = np.random.default_rng(0).standard_normal((WIDTH, WIDTH), dtype=np.float32) / np.sqrt(WIDTH)
    return export_bundle(layer, [np.zeros((1, WIDTH), np.float32)], {"w": weights}, directory=models / MODEL,
                         batch_sizes=BATCH_SIZES, provenance=False)


def direct_rows_per_second(folder: Path, batches: tuple[int, ...], seconds: float, repeat: int) -> dict[int, float]:
    """Median rows/s of the loaded bundle's own infer at each batch size, alternating sizes (no server)."""
    from nereid.backend import ModelContext
    from nereid.backends.xla.model import XlaModel
    from nereid.settings import ModelSettings
    from nereid.tensors import NamedTensor

    with tempfile.TemporaryDirectory() as scratch:
        model = XlaModel(ModelContext(MODEL, folder, ModelSettings(MODEL), Path(scratch)))
        model.load()
        samples: dict[int, list[float]] = {batch: [] for batch in batches}
        for _ in range(repeat):
            for batch in batches:
                inputs = [NamedTensor("input", model.signature().inputs[0].dtype,
                                      np.ones((batch, WIDTH), np.float32))]
                for _ in range(5):
                    model.infer(inputs)
                calls, started = 0, time.perf_counter()
                while time.perf_counter() - started < seconds:
                    model.infer(inputs)
                    calls += 1
                samples[batch].append(calls * batch / (time.perf_counter() - started))
        model.unload()
    return {batch: statistics.median(values) for batch, values in samples.items()}


def served(root: Path, batching: str, concurrency: int, *perf_analyzer_flags: str) -> dict[str, float]:
    config = root / "nereid.yaml"
    config.write_text(f'server:\n  ml_backends_path: ml-backends\n  metrics_addr: ""\n'
                      f"models:\n  - name: {MODEL}\n    queue_capacity: {4 * concurrency}\n"
                      f"    batching: {batching}\n")
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "nereid.cli", "serve", "--config", str(config), "--bind", address,
            "--log-level", "WARNING"]
    with running(argv, address, lambda a: wait_model_ready(a, MODEL)):
        return perf_analyzer(address, MODEL, concurrency, *perf_analyzer_flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="max_queue_delay_ms when batching is on")
    parser.add_argument("--repeat", type=int, default=3, help="off/on pairs; the median of each is reported")
    parser.add_argument("--streaming", action="store_true", help="perf_analyzer --streaming (ModelStreamInfer)")
    args = parser.parse_args()
    batching_on = f"{{preferred_batch_sizes: [{BATCH_SIZES[-1]}], max_queue_delay_ms: {args.delay_ms:g}}}"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = export(root / "ml-backends")
        direct = direct_rows_per_second(folder, (1, 16), args.seconds, args.repeat)
        flags = ("--streaming",) if args.streaming else ()
        # Alternate off and on, so that a slow spell of this shared machine hits both alike.
        runs = [(served(root, "{enabled: false}", args.concurrency, *flags)["throughput"],
                 served(root, batching_on, args.concurrency, *flags)["throughput"]) for _ in range(args.repeat)]
    off = {"throughput": statistics.median(r[0] for r in runs)}
    on = {"throughput": statistics.median(r[1] for r in runs)}
    direct_gain = direct[16] / direct[1]
    served_gain = on["throughput"] / off["throughput"]
    print("served runs (off, on) rows/s: " + ", ".join(f"({a:.0f}, {b:.0f})" for a, b in runs))
    print_table(f"Batching gain, {MODEL} (x @ W, W {WIDTH}x{WIDTH} float32), batch sizes {list(BATCH_SIZES)}",
                ["measurement", "rows/s", "gain"],
                [["direct infer, batch 1 (median)", direct[1], "1.00x"],
                 ["direct infer, batch 16 (median)", direct[16], f"{direct_gain:.2f}x"],
                 [f"served, batching off, concurrency {args.concurrency} (median)", off["throughput"], "1.00x"],
                 [f"served, batching {batching_on}, concurrency {args.concurrency} (median)", on["throughput"],
                  f"{served_gain:.2f}x"]])
    mode = "ModelStreamInfer" if args.streaming else "ModelInfer"
    print(f"\nserved gain / direct gain ({mode}): {served_gain / direct_gain:.1%} (target: 80% or better)")


if __name__ == "__main__":
    main()
