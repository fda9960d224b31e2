"""Protocol overhead: nereid serving an in-process identity model vs a bare grpcio echo servicer.

Both get the same perf_analyzer load at concurrency 1, 8 and 32, with a small
tensor and with 4 MiB requests, alternating bare / nereid ``--repeat`` times
in one run (so that a slow spell of this shared machine hits both alike).
nereid serves the identity twice: with a plain ``def infer`` run on the
scheduler's worker threads, the way real blocking backends run (python, xla,
cxx), and with ``async def infer`` on the event loop, the way the meta
backend's models run. Prints the median throughputs side by side and each
one's share of the bare servicer's.

    python3 bench/bench_protocol.py [--concurrency 1 8 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import BENCH_DIR, free_port, perf_analyzer, print_table, running, wait_model_ready
from identity_backend import write_identity_models

CASES = {"small (16 x FP32)": [16], "large (4 MiB FP32)": [1 << 20]}
MAX_BATCH_SIZE = 8
# The model served for each side of the comparison (the bare servicer answers any name).
MODELS = {"thread": "identity_thread", "loop": "identity"}


def nereid_config(root: Path, shape: list[int], http_addr: str = "") -> Path:
    """Both identity models with ``shape``; HTTP off unless ``http_addr`` is given."""
    dims = ", ".join(map(str, shape))
    write_identity_models(root / "ml-backends",
                          f"input_shape: [{dims}]\noutput_shape: [{dims}]\nmax_batch_size: {MAX_BATCH_SIZE}\n", MODELS)
    config = root / "nereid.yaml"
    config.write_text(f'server:\n  ml_backends_path: ml-backends\n  metrics_addr: ""\n  http_addr: "{http_addr}"\n'
                      "models:\n" + "".join(f"  - name: {name}\n    queue_capacity: 256\n" for name in MODELS.values()))
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeat", type=int, default=3, help="bare/nereid rounds per row; medians are reported")
    args = parser.parse_args()
    rows = []
    for case, shape in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            config = nereid_config(Path(tmp), shape)
            for concurrency in args.concurrency:
                runs: dict[str, list[dict[str, float]]] = {"bare": [], **{side: [] for side in MODELS}}
                for round_ in range(args.repeat):
                    address = f"127.0.0.1:{free_port()}"
                    bare = [sys.executable, str(BENCH_DIR / "bare_servicer.py"), address,
                            ",".join(map(str, shape)), str(MAX_BATCH_SIZE)]
                    with running(bare, address):
                        runs["bare"].append(perf_analyzer(address, "identity", concurrency))
                    address = f"127.0.0.1:{free_port()}"
                    nereid = [sys.executable, str(BENCH_DIR / "serve_with_plugin.py"), str(config), address]
                    with running(nereid, address, lambda a: [wait_model_ready(a, m) for m in MODELS.values()]):
                        # (The two sides in turn first: the one measured second met a server warmed by the first.)
                        sides = list(MODELS.items())
                        for side, model in sides if round_ % 2 == 0 else sides[::-1]:
                            runs[side].append(perf_analyzer(address, model, concurrency))
                median = {side: {key: statistics.median(r[key] for r in results) for key in results[0]}
                          for side, results in runs.items()}
                bare_rate = median["bare"]["throughput"]
                rows.append([case, concurrency, bare_rate, median["thread"]["throughput"],
                             median["loop"]["throughput"], median["bare"]["p50_us"], median["thread"]["p50_us"],
                             median["loop"]["p50_us"], f"{median['thread']['throughput'] / bare_rate:.1%}",
                             f"{median['loop']['throughput'] / bare_rate:.1%}"])
    print_table("Protocol overhead: nereid (identity model) vs bare grpcio servicer, perf_analyzer (infer/s)",
                ["case", "conc.", "bare", "nereid thread", "nereid loop", "bare p50 us", "thread p50 us",
                 "loop p50 us", "thread / bare", "loop / bare"], rows)
    print(f"(medians of {args.repeat} alternating rounds each; thread: a plain def infer on worker threads, "
          "as real blocking models run; loop: async def infer on the event loop)")


if __name__ == "__main__":
    main()
