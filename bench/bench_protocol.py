"""Protocol overhead: nereid serving an in-process identity model vs a bare grpcio echo servicer.

Both get the same perf_analyzer load at concurrency 1, 8 and 32, with a small
tensor and with 4 MiB requests, alternating bare / nereid ``--repeat`` times
in one run (so that a slow spell of this shared machine hits both alike).
Prints the median throughputs side by side and nereid's share of the bare
servicer's.

    python3 bench/bench_protocol.py [--concurrency 1 8 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import BENCH_DIR, free_port, perf_analyzer, print_table, running, wait_model_ready

CASES = {"small (16 x FP32)": [16], "large (4 MiB FP32)": [1 << 20]}
MAX_BATCH_SIZE = 8


def nereid_config(root: Path, shape: list[int]) -> Path:
    folder = root / "ml-backends" / "identity"
    folder.mkdir(parents=True)
    (folder / "identity.txt").write_text("")
    dims = ", ".join(map(str, shape))
    (folder / "model_inference.textproto").write_text(
        f"input_shape: [{dims}]\noutput_shape: [{dims}]\nmax_batch_size: {MAX_BATCH_SIZE}\n")
    config = root / "nereid.yaml"
    config.write_text('server:\n  ml_backends_path: ml-backends\n  metrics_addr: ""\n'
                      "models:\n  - name: identity\n    queue_capacity: 256\n")
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeat", type=int, default=3, help="bare/nereid pairs per row; medians are reported")
    args = parser.parse_args()
    rows = []
    for case, shape in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            config = nereid_config(Path(tmp), shape)
            for concurrency in args.concurrency:
                runs = {"bare": [], "nereid": []}
                for _ in range(args.repeat):
                    address = f"127.0.0.1:{free_port()}"
                    bare = [sys.executable, str(BENCH_DIR / "bare_servicer.py"), address,
                            ",".join(map(str, shape)), str(MAX_BATCH_SIZE)]
                    with running(bare, address):
                        runs["bare"].append(perf_analyzer(address, "identity", concurrency))
                    address = f"127.0.0.1:{free_port()}"
                    nereid = [sys.executable, str(BENCH_DIR / "serve_with_plugin.py"), str(config), address]
                    with running(nereid, address, lambda a: wait_model_ready(a, "identity")):
                        runs["nereid"].append(perf_analyzer(address, "identity", concurrency))
                median = {side: {key: statistics.median(r[key] for r in results) for key in results[0]}
                          for side, results in runs.items()}
                ratio = median["nereid"]["throughput"] / median["bare"]["throughput"]
                rows.append([case, concurrency, median["bare"]["throughput"], median["nereid"]["throughput"],
                             median["bare"]["p50_us"], median["nereid"]["p50_us"], f"{ratio:.1%}"])
    print_table("Protocol overhead: nereid (identity model) vs bare grpcio servicer, perf_analyzer",
                ["case", "concurrency", "bare infer/s", "nereid infer/s", "bare p50 us", "nereid p50 us",
                 "nereid / bare"], rows)
    print(f"(medians of {args.repeat} alternating runs each)")


if __name__ == "__main__":
    main()
