"""Batching gain: a memory-bound bundle served with dynamic batching, against what batching could reach.

    python3 bench/bench_batching.py [--concurrency 16] [--seconds 3] [--repeat 3]

The bundle is one 2048x2048 float32 layer (16 MiB of weights read per call),
compiled for batch sizes 1, 4 and 16 by nereid.backends.xla.export.

- Direct: the loaded bundle's ``infer`` called in a loop at batch 1 and at
  batch 16, in this process (rows per second); their ratio is the program's
  own gain from batching.
- Served: perf_analyzer at the given concurrency, one row (8 KiB) per request,
  against `nereid serve` with batching off, with ``{max_queue_delay_ms: 1}``
  and no preferred sizes (no tuning), with a 4 ms delay, and with the best
  settings found (the largest compiled size preferred, and a delay that lets
  the answered clients come back in time to fill the next batch).
- Bare: a bare grpcio servicer (bench/bare_servicer.py) answering the same
  requests; no server can be faster than that over gRPC.

The ceiling is min(direct gain x served unbatched rate, bare servicer rate);
the figure reported is served / ceiling. Target: 70% with
``max_queue_delay_ms: 1`` and no preferred sizes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import BENCH_DIR, free_port, perf_analyzer, print_table, running, wait_model_ready

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
    config.write_text(f'server:\n  ml_backends_path: ml-backends\n  metrics_addr: ""\n  http_addr: ""\n'
                      f"models:\n  - name: {MODEL}\n    queue_capacity: {4 * concurrency}\n"
                      f"    batching: {batching}\n")
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "nereid.cli", "serve", "--config", str(config), "--bind", address,
            "--log-level", "WARNING"]
    with running(argv, address, lambda a: wait_model_ready(a, MODEL)):
        return perf_analyzer(address, MODEL, concurrency, *perf_analyzer_flags)


def bare(concurrency: int, *perf_analyzer_flags: str) -> float:
    """infer/s of the bare grpcio servicer answering the same one-row requests."""
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, str(BENCH_DIR / "bare_servicer.py"), address, str(WIDTH), str(BATCH_SIZES[-1])]
    with running(argv, address):
        return perf_analyzer(address, MODEL, concurrency, *perf_analyzer_flags)["throughput"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--best-delay-ms", type=float, default=50.0,
                        help="max_queue_delay_ms of the tuned settings (with the largest size preferred)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of every measurement; medians are reported")
    parser.add_argument("--streaming", action="store_true", help="perf_analyzer --streaming (ModelStreamInfer)")
    args = parser.parse_args()
    settings = {
        "off": "{enabled: false}",
        "untuned": "{max_queue_delay_ms: 1}",
        "delay 4": "{max_queue_delay_ms: 4}",
        "tuned": f"{{preferred_batch_sizes: [{BATCH_SIZES[-1]}], max_queue_delay_ms: {args.best_delay_ms:g}}}",
    }
    flags = ("--streaming",) if args.streaming else ()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = export(root / "ml-backends")
        direct = direct_rows_per_second(folder, (1, 16), args.seconds, args.repeat)
        # Rounds of every measurement in turn, so that a slow spell of this shared machine hits all alike.
        runs: dict[str, list[float]] = {name: [] for name in [*settings, "bare"]}
        for _ in range(args.repeat):
            for name, batching in settings.items():
                runs[name].append(served(root, batching, args.concurrency, *flags)["throughput"])
            runs["bare"].append(bare(args.concurrency, *flags))
    median = {name: statistics.median(values) for name, values in runs.items()}
    direct_gain = direct[16] / direct[1]
    ceiling = min(direct_gain * median["off"], median["bare"])
    print("runs, infer/s: " + "; ".join(f"{name} {', '.join(f'{v:.0f}' for v in values)}"
                                       for name, values in runs.items()))
    rows = [["direct infer, batch 1", direct[1], "", ""],
            ["direct infer, batch 16", direct[16], f"{direct_gain:.2f}x", ""],
            ["bare grpcio servicer", median["bare"], "", ""],
            [f"ceiling: min({direct_gain:.2f} x served off, bare)", ceiling, "", "100%"]]
    rows += [[f"served, batching {batching}", median[name], f"{median[name] / median['off']:.2f}x",
              f"{median[name] / ceiling:.0%}"] for name, batching in settings.items()]
    mode = "ModelStreamInfer" if args.streaming else "ModelInfer"
    print_table(f"Batching, {MODEL} (x @ W, W {WIDTH}x{WIDTH} float32), batch sizes {list(BATCH_SIZES)}, "
                f"{mode}, concurrency {args.concurrency} (medians of {args.repeat})",
                ["measurement", "rows/s", "gain", "of ceiling"], rows)
    print(f"\nserved / ceiling with max_queue_delay_ms 1, no preferred sizes: "
          f"{median['untuned'] / ceiling:.1%} (target: 70% or better)")


if __name__ == "__main__":
    main()
