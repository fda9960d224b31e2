"""Host-to-device transfers of the xla backend: jaxlib's batched_device_put vs jax.device_put.

    python3 bench/bench_xla_transfer.py [--seconds 2] [--repeat 3]

No server and no perf_analyzer: the loaded bundles' own ``infer`` (what a
worker thread runs for every batch) in this process, on the CPU device.

- The transfer alone, one 16 x 2048 float32 array: with warm caches, and right
  after 32 MiB has been read (what an execution of a large model does to the
  caches), through each path.
- ``infer`` of two bundles through each path, alternating in one run:
  mlp_bundle (a small two-layer MLP, batch 1; the transfer is a large part of
  its time) and one 2048 x 2048 float32 layer (batch 1 and 16; the program is
  most of it).

Prints medians (µs) and the direct path's speed-up.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from bench_batching import export  # the dense 2048 x 2048 bundle
from common import BENCH_DIR, print_table


def timed_us(call: Callable[[], object], seconds: float) -> float:
    """Mean µs per call over about ``seconds``."""
    for _ in range(20):
        call()
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        call()
        calls += 1
    return (time.perf_counter() - started) / calls * 1e6


def cold_us(call: Callable[[], object], rounds: int = 200) -> float:
    """Median µs of one call right after 32 MiB has been read."""
    sweep = np.ones(8 << 20, np.float32)
    samples = []
    for _ in range(rounds):
        sweep.sum()
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from nereid.backend import ModelContext
    from nereid.backends.xla.model import XlaModel
    from nereid.backends.xla.transfer import DeviceTransfer
    from nereid.settings import ModelSettings
    from nereid.tensors import NamedTensor

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shutil.copytree(BENCH_DIR.parent / "ml-backends" / "mlp_bundle", root / "mlp_bundle")
        dense = export(root / "dense")
        models = {}
        for name, folder in (("mlp_bundle", root / "mlp_bundle"), ("dense2048", dense)):
            model = XlaModel(ModelContext(name, folder, ModelSettings(name), root / f"{name}.scratch"))
            model.load()
            models[name] = model
        device = models["mlp_bundle"]._transfer.device
        paths = {"direct": DeviceTransfer(device), "jax.device_put": DeviceTransfer(device, direct=False)}
        assert paths["direct"].direct, "this jaxlib has no usable batched_device_put"

        array = np.ones((16, 2048), np.float32)
        cases: dict[str, tuple[str, int] | None] = {
            "transfer, warm": None, "transfer, after a 32 MiB read": None,
            "infer mlp_bundle, batch 1": ("mlp_bundle", 1),
            "infer dense2048, batch 1": ("dense2048", 1), "infer dense2048, batch 16": ("dense2048", 16)}
        samples: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeat):
            for case, target in cases.items():
                for path, transfer in paths.items():
                    if target is None:
                        measure = cold_us if "after" in case else lambda call: timed_us(call, args.seconds / 4)
                        value = measure(lambda: transfer.put([array])[0].block_until_ready())
                    else:
                        name, rows = target
                        model = models[name]
                        model._transfer = transfer  # the same model, each path in turn
                        width = model.signature().inputs[0].dims[-1]
                        inputs = [NamedTensor("input", model.signature().inputs[0].dtype,
                                              np.ones((rows, width), np.float32))]
                        value = timed_us(lambda: model.infer(inputs), args.seconds)
                    samples.setdefault((case, path), []).append(value)
        for model in models.values():
            model.unload()

    rows = []
    for case in cases:
        direct = statistics.median(samples[(case, "direct")])
        public = statistics.median(samples[(case, "jax.device_put")])
        rows.append([case, f"{public:.0f}", f"{direct:.0f}", f"{public / direct:.2f}x"])
    print_table(f"xla backend host-to-device transfers, CPU (medians of {args.repeat}, µs)",
                ["measurement", "jax.device_put", "batched_device_put", "speed-up"], rows)


if __name__ == "__main__":
    main()
