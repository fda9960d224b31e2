"""HTTP/REST overhead: nereid over HTTP (binary tensors) vs nereid over gRPC vs bare HTTP servers.

The same in-process identity model behind both of nereid's protocols (its
``async def infer`` on the event loop; over HTTP also the identity with a plain
``def infer`` on worker threads, the way blocking backends run); the
baselines are bare servers of the two HTTP stacks considered (uvicorn with
httptools, which nereid uses, and aiohttp) echoing the same binary requests
(bench/bare_http.py). perf_analyzer drives each at concurrency 1, 8 and 32,
with 16 x FP32 tensors (4 MiB ones at 1 and 8 only), alternating the servers ``--repeat`` times
in one run. Prints median throughputs and nereid-over-HTTP's share of the bare
uvicorn server and of nereid over gRPC.

    python3 bench/bench_http.py [--concurrency 1 8 32] [--repeat 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_protocol import CASES, MAX_BATCH_SIZE, MODELS, nereid_config
from common import BENCH_DIR, free_port, perf_analyzer, print_table, running, wait_model_ready


def wait_http(address: str) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://{address}/v2", timeout=1).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for case, shape in CASES.items():
        dims = ",".join(map(str, shape))
        with tempfile.TemporaryDirectory() as tmp:
            http_port = free_port()
            config = nereid_config(Path(tmp), shape, f"127.0.0.1:{http_port}")
            # 32 clients of 4 MiB each do not give perf_analyzer a stable 2 s window on 2 cores.
            for concurrency in [c for c in args.concurrency if shape == CASES["small (16 x FP32)"] or c <= 8]:
                sides = ("uvicorn", "aiohttp", "nereid http", "nereid http thread", "nereid grpc")
                runs: dict[str, list[float]] = {side: [] for side in sides}
                for _ in range(args.repeat):
                    for stack in ("uvicorn", "aiohttp"):
                        address = f"127.0.0.1:{free_port()}"
                        bare = [sys.executable, str(BENCH_DIR / "bare_http.py"), stack, address, dims,
                                str(MAX_BATCH_SIZE)]
                        with running(bare, address, wait_http, grpc_check=False):
                            runs[stack].append(perf_analyzer(address, "identity", concurrency,
                                                             protocol="http")["throughput"])
                    address = f"127.0.0.1:{free_port()}"
                    nereid = [sys.executable, str(BENCH_DIR / "serve_with_plugin.py"), str(config), address]
                    with running(nereid, address, lambda a: [wait_model_ready(a, m) for m in MODELS.values()]):
                        for side, model in (("nereid http", MODELS["loop"]), ("nereid http thread", MODELS["thread"])):
                            runs[side].append(perf_analyzer(f"127.0.0.1:{http_port}", model, concurrency,
                                                            protocol="http")["throughput"])
                        runs["nereid grpc"].append(perf_analyzer(address, MODELS["loop"], concurrency)["throughput"])
                median = {side: statistics.median(values) for side, values in runs.items()}
                rows.append([case, concurrency, median["uvicorn"], median["aiohttp"], median["nereid http"],
                             median["nereid http thread"], median["nereid grpc"],
                             f"{median['nereid http'] / median['uvicorn']:.1%}",
                             f"{median['nereid http thread'] / median['uvicorn']:.1%}",
                             f"{median['nereid http'] / median['nereid grpc']:.2f}x"])
    print_table("HTTP: nereid (identity model, binary tensors) vs bare HTTP servers and nereid's gRPC (infer/s)",
                ["case", "conc.", "bare uvicorn", "bare aiohttp", "nereid http", "http thread", "nereid grpc",
                 "http / bare uvicorn", "thread / bare uvicorn", "http / grpc"], rows)
    print(f"(medians of {args.repeat} alternating runs each)")


if __name__ == "__main__":
    main()
