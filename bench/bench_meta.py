"""Meta models: a meta model that calls one in-process bundle, against calling the bundle directly.

One server serves the shipped ``mlp_bundle`` (xla, [batch, 16] FP32 ->
[batch, 4], dynamic batching on) and ``mlp_meta``, a meta model with the same
wire tensors whose ``async def`` orchestration is one ``await
ctx.infer("mlp_bundle", inputs)``. A request to ``mlp_meta`` therefore pays
everything a direct one does (gRPC, validation, mlp_bundle's queue and batch)
plus the meta model's own path: its validation and scheduler, the
orchestration coroutine, and a second pass through the data plane.

perf_analyzer drives each model at every concurrency, alternating the models
``--repeat`` times so that a slow spell of this shared machine hits both
alike; medians are reported with the overhead per request and the ratio the
issue sets a target for (meta >= 85% of direct throughput at concurrency 16).
The server's own CPU time per request (its /proc stat over the requests its
ModelStatistics counted) is reported too: other processes' load on a shared
machine moves throughput a lot and CPU time per request little.

    python3 bench/bench_meta.py [--concurrency 1 16] [--repeat 3]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tritonclient.grpc as triton

from common import REPO_ROOT, alternating_models, free_port, models_args, perf_analyzer, print_table

MODELS = ("mlp_meta", "mlp_bundle")

META_MANIFEST = """\
format_version: "2.1"
meta: true
depends_on: [mlp_bundle]
client_inputs: [{name: input, dtype: f32, shape: an, dims: {a: 16}}]
client_outputs: [{name: output, dtype: f32, shape: an, dims: {a: 4}}]
batching: {max_batch_size: 32}
"""

META_MODEL_PY = """\
import nereid


async def orchestrate(inputs, ctx):
    return await ctx.infer("mlp_bundle", inputs)


nereid.register_model(orchestrate=orchestrate)
"""


def config(root: Path) -> Path:
    """A repository with the shipped mlp_bundle and a meta model relaying to it."""
    models = root / "ml-backends"
    shutil.copytree(REPO_ROOT / "ml-backends" / "mlp_bundle", models / "mlp_bundle",
                    ignore=shutil.ignore_patterns(".cache"))  # compiled at load, out of the timed runs
    meta = models / "mlp_meta"
    meta.mkdir()
    (meta / "manifest.yaml").write_text(META_MANIFEST)
    (meta / "model.py").write_text(META_MODEL_PY)
    path = root / "nereid.yaml"
    path.write_text('server:\n  ml_backends_path: ml-backends\n  metrics_addr: ""\n  http_addr: ""\nmodels:\n'
                    '  - {name: mlp_bundle, queue_capacity: 64}\n'
                    '  - {name: mlp_meta, queue_capacity: 64}\n')
    return path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served(address: str, model: str) -> int:
    """Requests the model has answered successfully (ModelStatistics)."""
    client = triton.InferenceServerClient(address)
    try:
        return client.get_inference_statistics(model, as_json=False).model_stats[0].inference_count
    finally:
        client.close()


def main() -> None:
    args = models_args(__doc__.splitlines()[0])
    with tempfile.TemporaryDirectory() as tmp:
        path = config(Path(tmp))
        address = f"127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "nereid.cli", "serve", "--config", str(path), "--bind", address,
                "--log-level", "WARNING"]

        def measure(server: subprocess.Popen, model: str, concurrency: int) -> dict[str, float]:
            cpu, count = cpu_seconds(server.pid), served(address, model)
            result = perf_analyzer(address, model, concurrency)
            requests = served(address, model) - count
            result["cpu_us"] = (cpu_seconds(server.pid) - cpu) * 1e6 / max(requests, 1)
            return result
        median = alternating_models(argv, address, MODELS, args.concurrency, args.repeat, measure)
    rows = []
    for concurrency in args.concurrency:
        meta, direct = (median[(model, concurrency)] for model in MODELS)
        # Server time per request at this concurrency: what one more pass through the meta model costs.
        overhead_us = 1e6 / meta["throughput"] - 1e6 / direct["throughput"]
        rows.append([concurrency, meta["throughput"], direct["throughput"], meta["p50_us"], direct["p50_us"],
                     f"{meta['p50_us'] - direct['p50_us']:.0f}", f"{overhead_us:.0f}",
                     f"{meta['cpu_us']:.0f}", f"{direct['cpu_us']:.0f}",
                     f"{meta['throughput'] / direct['throughput']:.0%}", f"{direct['cpu_us'] / meta['cpu_us']:.0%}"])
    print_table("mlp_bundle ([batch, 16] FP32, batch 1 requests): through a meta model vs direct "
                "(perf_analyzer, one server)",
                ["conc.", "meta infer/s", "direct infer/s", "meta p50 us", "direct p50 us", "p50 overhead us",
                 "overhead us/request", "meta cpu us/req", "direct cpu us/req", "meta / direct",
                 "cpu direct / meta"], rows)
    print(f"(medians of {args.repeat} runs each, models alternating; overhead us/request = 1e6/meta - 1e6/direct "
          "throughput; cpu us/req: the server process's CPU time per request answered; "
          "target: meta / direct >= 85% at concurrency 16)")


if __name__ == "__main__":
    main()
