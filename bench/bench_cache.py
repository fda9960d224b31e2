"""Server start-up with a warm executable cache vs a cold one.

    python bench/bench_cache.py [--layers 8] [--width 512] [--repeat 3]

Exports a deep MLP bundle (batch sizes 1, 8, 32, 128) into a temporary model
repository, then starts a real nereid server in a fresh process again and
again, alternating: cold (``.cache/`` deleted first, every program compiled)
and warm (executables deserialized from ``.cache/``). Each start is measured
from spawning the process to the model being READY; the model's own load time
(manifest, programs, weights) and the one-time jax import and CPU client start
(done first, timed on their own) are reported as well. Prints the medians and
the cold/warm ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

BATCH_SIZES = (1, 8, 32, 128)

# Runs in the child: start a server on a free port, load the models, report, stop.
CHILD = textwrap.dedent("""
    import asyncio, json, sys, time
    started = time.perf_counter()
    import jax.extend.backend  # the one-time jax import and CPU client start, timed on their own
    jax.extend.backend.get_backend("cpu")
    jax_s = time.perf_counter() - started
    from nereid.server import NereidServer
    from nereid.settings import load_settings

    async def main():
        server = NereidServer(load_settings(sys.argv[1]))
        await server.start()
        await server.load_models()
        entry = server.repository.entry("deep_mlp")
        loaded = entry.loaded
        report = loaded.backend.report if loaded else None
        print(json.dumps({"state": entry.state.value, "reason": entry.reason, "jax_s": jax_s,
                          "load_s": loaded.load_seconds if loaded else None,
                          "hits": report.cache.hits if report else None,
                          "compiled": report.cache.compiled if report else None}))
        await server.stop(grace_s=1)

    asyncio.run(main())
""")


def deep_mlp(x, *weights):
    import jax

    for w, b in zip(weights[::2], weights[1::2]):
        x = jax.nn.gelu(x @ w + b)
    return x


def export(root: Path, layers: int, width: int) -> Path:
    from nereid.backends.xla.export import export_bundle

    rng = np.random.default_rng(0)
    weights = {}
    for i in range(layers):
        weights[f"w{i}"] = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        weights[f"b{i}"] = np.zeros(width, np.float32)
    return export_bundle(deep_mlp, [np.zeros((1, width), np.float32)], weights, directory=root / "deep_mlp",
                         batch_sizes=BATCH_SIZES, provenance=False)


def start_once(config: Path) -> dict:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", CHILD, str(config)], capture_output=True, text=True, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["process_s"] = time.perf_counter() - started
    if report["state"] != "READY":
        sys.exit(f"the model did not load: {report['reason']}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ml-backends"
        root.mkdir()
        bundle = export(root, args.layers, args.width)
        config = Path(tmp) / "nereid.yaml"
        config.write_text('server:\n  bind_addr: "127.0.0.1:0"\n  ml_backends_path: "ml-backends"\n'
                          '  metrics_addr: ""\n  http_addr: ""\nmodels:\n  - name: deep_mlp\n')
        runs: dict[str, list[dict]] = {"cold": [], "warm": []}
        for _ in range(args.repeat):
            shutil.rmtree(bundle / ".cache", ignore_errors=True)
            runs["cold"].append(start_once(config))
            runs["warm"].append(start_once(config))  # the cold start just filled the cache
    print(f"deep_mlp: {args.layers} layers of {args.width}, batch sizes {list(BATCH_SIZES)} "
          f"({len(BATCH_SIZES)} programs); median of {args.repeat} starts each")
    print(f"{'cache':<6} {'compiled':>9} {'from cache':>11} {'model load s':>13} {'jax import s':>13} "
          f"{'spawn→READY s':>14}")
    medians = {}
    for case in ("cold", "warm"):
        load = statistics.median(r["load_s"] for r in runs[case])
        process = statistics.median(r["process_s"] for r in runs[case])
        jax_s = statistics.median(r["jax_s"] for r in runs[case])
        medians[case] = (load, process)
        last = runs[case][-1]
        print(f"{case:<6} {last['compiled']:>9} {last['hits']:>11} {load:>13.3f} {jax_s:>13.3f} {process:>14.3f}")
    print(f"cold/warm: model load {medians['cold'][0] / medians['warm'][0]:.2f}x, "
          f"spawn→READY {medians['cold'][1] / medians['warm'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
