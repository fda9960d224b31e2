"""Soak: a watched repository churned under load; every request must get an answer that fits.

One ``nereid serve`` with ``watch: true`` serves python echo models, ``cpp_scale``
and ``cxx_scale`` copies, ``mlp_bundle`` copies and meta models that call an
echo, while four gRPC clients and two HTTP clients call random names and
``/metrics`` is scraped every 50 ms, and the repository is churned every
0.05-0.6 s (seeded):

- folders added, copied, renamed, swapped, deleted; ``main.py`` edited, broken
  and fixed; textprotos broken and fixed; bundle manifests touched, weights and
  programs truncated and restored; cxx sources edited (a rebuild), broken and
  fixed; meta ``model.py`` broken and fixed (and the echoes a meta model
  depends on churned under it);
- nereid.yaml rewritten (entries with other instances, queues and batching,
  entries for folders that do not exist, no models key, invalid YAML);
- RepositoryModelLoad / Unload on random names.

A request may be answered OK (checked: echoes and meta models echo, cpp and
cxx double, the MLP has 4 outputs a row), NOT_FOUND (the name just went), or
UNAVAILABLE (loading, unloaded, or its folder is broken); over HTTP, 200, 404
or 503. Anything else is a failure: INTERNAL from a model that loaded,
INVALID_ARGUMENT for a well-formed request, a call over 20 s. At the end every folder is repaired; after they settle each must be
READY, RepositoryIndex must list no folder that is gone, and the server must
have no zombie children and stop cleanly on SIGTERM.

    python3 bench/soak_repository.py [--seconds 60] [--seed 1]

Exits 1 on a failure, printing each kind once. Found, while it was being
written: runs failing after their folder moved, the wrong code running after
a rename, a file rewritten during a load slipping in unchecked, a rebuild
removing the binary of the version still serving, and ghost index entries.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import numpy as np
import tritonclient.grpc as triton
import tritonclient.http as triton_http
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, free_port, wait_until_serving  # noqa: E402

EXAMPLES = REPO_ROOT / "ml-backends"
TEXTPROTO = "input_shape: [4]\noutput_shape: [4]\nmax_batch_size: 8\n"
ECHO_MAIN = '''import os, sys
data = sys.stdin.buffer.read()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("%s %s\\n" % (os.environ["NEREID_INPUT_DTYPE"], os.environ["NEREID_INPUT_SHAPE"])).encode() + data)
'''
NUMPY_MAIN = '''import os, sys
import numpy as np
x = np.frombuffer(sys.stdin.buffer.read(), np.float32)
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("%s %s\\n" % (os.environ["NEREID_INPUT_DTYPE"], os.environ["NEREID_INPUT_SHAPE"])).encode() + x.tobytes())
'''
BROKEN_MAIN = "def broken(:\n"
META_MANIFEST = ('format_version: "2.1"\nmeta: true\ndepends_on: [{echo}]\nbatching: {{max_batch_size: 8}}\n'
                 "client_inputs: [{{name: input, dtype: f32, shape: an, dims: {{a: 4}}}}]\n"
                 "client_outputs: [{{name: output, dtype: f32, shape: an, dims: {{a: 4}}}}]\n")
# An async orchestration (on the event loop) and a plain one (on a worker thread), both echoing through an echo.
META_MODEL = {
    "async": """import nereid
from nereid.tensors import NamedTensor

async def orchestrate(inputs, ctx):
    (out,) = await ctx.infer("{echo}", [NamedTensor.from_array("input", inputs[0].data)])
    return [NamedTensor.from_array("output", out.data)]

nereid.register_model(orchestrate=orchestrate)
""",
    "sync": """import nereid
from nereid.tensors import NamedTensor

def orchestrate(inputs, ctx):
    (out,) = ctx.infer("{echo}", [NamedTensor.from_array("input", inputs[0].data)])
    return [NamedTensor.from_array("output", out.data)]

nereid.register_model(orchestrate=orchestrate)
"""}
BROKEN_CXX = "int nereid_infer(  // cut short\n"
# A cxx folder says nothing of its backend: nereid.yaml names cxx0-cxx3, whichever of them exist.
CXX_ENTRIES = "".join(f"  - name: cxx{n}\n    backend: cxx\n    instances: 2\n"
                      f"    runtime: {{sources: [ml-backends/cxx{n}/scale.cpp]}}\n" for n in range(4))
SERVER_YAML = ('server:\n  ml_backends_path: ml-backends\n  metrics_addr: "127.0.0.1:{metrics_port}"\n'
               '  http_addr: "127.0.0.1:{http_port}"\n'
               "  watch: true\n  watch_settle_ms: 300\n")
EXPECTED = {"StatusCode.NOT_FOUND", "StatusCode.UNAVAILABLE", "404", "503"}
# Each folder's kind is its name without the trailing digits; renames keep it.
WIDTH = {"echo": 4, "meta": 4, "cpp": 8, "cxx": 8, "mlp": 16}


class Soak:
    def __init__(self, root: Path, seed: int) -> None:
        self.root = root
        self.models = root / "ml-backends"
        self.rng = random.Random(seed)
        self.address = f"127.0.0.1:{free_port()}"
        self.http_address = f"127.0.0.1:{free_port()}"
        self.metrics_address = f"127.0.0.1:{free_port()}"
        self.server_yaml = SERVER_YAML.format(http_port=self.http_address.rpartition(":")[2],
                                              metrics_port=self.metrics_address.rpartition(":")[2])
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self.actions: collections.Counter[str] = collections.Counter()
        self.stop = threading.Event()

    # -- the repository ---------------------------------------------------------------------------
    def write_echo(self, folder: Path, main: str = ECHO_MAIN) -> None:
        staging = folder.with_name(f".{folder.name}.tmp")  # hidden from the watcher until renamed in
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        (staging / "model_inference.textproto").write_text(TEXTPROTO)
        (staging / "main.py").write_text(main)
        os.rename(staging, folder)

    def populate(self) -> None:
        self.models.mkdir()
        for index in range(3):
            self.write_echo(self.models / f"echo{index}")
        for index in range(2):
            shutil.copytree(EXAMPLES / "cpp_scale", self.models / f"cpp{index}")
            shutil.copytree(EXAMPLES / "cxx_scale", self.models / f"cxx{index}")
            self.write_meta(self.models / f"meta{index}", f"echo{index}", ("async", "sync")[index])
        shutil.copytree(EXAMPLES / "mlp_bundle", self.models / "mlp0", ignore=shutil.ignore_patterns(".cache"))
        (self.root / "nereid.yaml").write_text(self.base_yaml())

    def write_meta(self, folder: Path, echo: str, style: str) -> None:
        staging = folder.with_name(f".{folder.name}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        (staging / "manifest.yaml").write_text(META_MANIFEST.format(echo=echo))
        (staging / "model.py").write_text(META_MODEL[style].replace("{echo}", echo))
        os.rename(staging, folder)

    def base_yaml(self) -> str:
        return self.server_yaml + "models:\n" + CXX_ENTRIES

    def live(self, kind: str = "") -> list[Path]:
        return [p for p in self.models.iterdir()
                if not p.name.startswith(".") and (not kind or p.name.rstrip("0123456789") == kind)]

    def churn_once(self) -> str:
        rng = self.rng
        kind = rng.choice(["add", "rename", "swap", "delete", "edit", "break", "fix", "numpy", "textproto",
                           "cpp_copy", "cpp_rename", "cpp_delete", "mlp_copy", "mlp_touch", "mlp_break",
                           "mlp_fix", "cxx_copy", "cxx_rename", "cxx_edit", "cxx_break", "cxx_fix",
                           "meta_add", "meta_rename", "meta_break", "meta_fix",
                           "yaml", "yaml", "api_load", "api_unload", "none"])
        echoes, cpps, mlps = self.live("echo"), self.live("cpp"), self.live("mlp")
        cxxs, metas = self.live("cxx"), self.live("meta")
        try:
            if kind == "add":
                target = self.models / f"echo{rng.randint(0, 9)}"
                if not target.exists():
                    self.write_echo(target)
            elif kind in ("rename", "cxx_rename", "meta_rename") and (echoes + mlps if kind == "rename"
                                                                       else cxxs if kind == "cxx_rename" else metas):
                folder = rng.choice(echoes + mlps if kind == "rename" else cxxs if kind == "cxx_rename" else metas)
                limit = 3 if kind == "cxx_rename" else 9  # only cxx0-cxx3 have entries
                target = self.models / f"{folder.name.rstrip('0123456789')}{rng.randint(0, limit)}"
                if not target.exists():
                    os.rename(folder, target)
            elif kind == "swap" and len(echoes) >= 2:
                first, second = rng.sample(echoes, 2)
                hold = self.models / ".swap"
                os.rename(first, hold)
                os.rename(second, first)
                os.rename(hold, second)
            elif kind == "delete" and len(echoes) > 1:
                shutil.rmtree(rng.choice(echoes))
            elif kind in ("edit", "break", "fix", "numpy") and echoes:
                main = {"edit": ECHO_MAIN + f"# {rng.random()}\n", "break": BROKEN_MAIN, "fix": ECHO_MAIN,
                        "numpy": NUMPY_MAIN}[kind]
                (rng.choice(echoes) / "main.py").write_text(main)
            elif kind == "textproto" and echoes:
                text = "input_shape: [oops\n" if rng.random() < 0.5 else TEXTPROTO
                (rng.choice(echoes) / "model_inference.textproto").write_text(text)
            elif kind == "cpp_copy":
                target = self.models / f"cpp{rng.randint(0, 5)}"
                if not target.exists():
                    shutil.copytree(EXAMPLES / "cpp_scale", target)
            elif kind == "cpp_rename" and cpps:
                target = self.models / f"cpp{rng.randint(0, 5)}"
                if not target.exists():
                    os.rename(rng.choice(cpps), target)
            elif kind == "cpp_delete" and len(cpps) > 1:
                shutil.rmtree(rng.choice(cpps))
            elif kind == "mlp_copy":
                target = self.models / f"mlp{rng.randint(0, 3)}"
                if not target.exists():
                    shutil.copytree(EXAMPLES / "mlp_bundle", target, ignore=shutil.ignore_patterns(".cache"))
            elif kind == "mlp_touch" and mlps:
                manifest = rng.choice(mlps) / "manifest.yaml"
                manifest.write_text(manifest.read_text() + f"\n# {rng.random()}\n")
            elif kind == "mlp_break" and mlps:
                folder = rng.choice(mlps)
                victim = rng.choice([folder / "weights.safetensors", *folder.glob("*.mlir")])
                data = victim.read_bytes()
                victim.write_bytes(data[:rng.randint(0, len(data))])
            elif kind == "mlp_fix" and mlps:
                self.restore_bundle(rng.choice(mlps))
            elif kind == "cxx_copy":
                target = self.models / f"cxx{rng.randint(0, 3)}"
                if not target.exists():
                    shutil.copytree(EXAMPLES / "cxx_scale", target)
            elif kind in ("cxx_edit", "cxx_break", "cxx_fix") and cxxs:
                source = (EXAMPLES / "cxx_scale" / "scale.cpp").read_text()
                text = {"cxx_edit": source + f"// {rng.random()}\n", "cxx_break": BROKEN_CXX,
                        "cxx_fix": source}[kind]
                (rng.choice(cxxs) / "scale.cpp").write_text(text)
            elif kind == "meta_add":
                index = rng.randint(0, 9)
                target = self.models / f"meta{index}"
                if not target.exists():
                    self.write_meta(target, f"echo{rng.randint(0, 9)}", rng.choice(["async", "sync"]))
            elif kind in ("meta_break", "meta_fix") and metas:
                folder = rng.choice(metas)
                if kind == "meta_break":
                    (folder / "model.py").write_text(BROKEN_MAIN)
                else:
                    self.fix_meta(folder)
            elif kind == "yaml":
                (self.root / "nereid.yaml").write_text(self.random_yaml())
            elif kind in ("api_load", "api_unload"):
                name = rng.choice([p.name for p in self.live()] + ["nonexistent"])
                client = triton.InferenceServerClient(self.address)
                try:
                    (client.load_model if kind == "api_load" else client.unload_model)(name)
                except InferenceServerException:
                    pass  # a broken folder fails to load, an unknown name is NOT_FOUND: both fine here
                finally:
                    client.close()
        except OSError:
            pass  # the folder went meanwhile (a client's rescan, our own earlier step)
        return kind

    def random_yaml(self) -> str:
        roll = self.rng.random()
        if roll < 0.15:
            return self.server_yaml + "models:\n  - name: [oops\n"
        if roll < 0.3:
            return self.server_yaml
        entries = "".join(f"  - name: echo{n}\n    instances: {self.rng.randint(1, 3)}\n"
                          f"    queue_capacity: {self.rng.choice([4, 16, 64])}\n"
                          f"    batching: {{max_queue_delay_ms: {self.rng.choice([0, 1, 5])}}}\n"
                          for n in self.rng.sample(range(10), self.rng.randint(1, 4)))
        return self.base_yaml() + entries

    @staticmethod
    def fix_meta(folder: Path) -> None:
        echo = re.search(r"depends_on: \[(\w+)\]", (folder / "manifest.yaml").read_text()).group(1)
        (folder / "model.py").write_text(META_MODEL["async"].replace("{echo}", echo))

    @staticmethod
    def restore_bundle(folder: Path) -> None:
        shutil.copy(EXAMPLES / "mlp_bundle" / "weights.safetensors", folder / "weights.safetensors")
        for program in (EXAMPLES / "mlp_bundle").glob("*.mlir"):
            shutil.copy(program, folder / program.name)

    def repair(self) -> None:
        (self.root / "nereid.yaml").write_text(self.base_yaml())
        # Applied before the loads below: applied after them, it would unload the models the churned nereid.yaml
        # listed and this one does not, loaded or not (as it should: their entries were taken out).
        time.sleep(2.0)
        for folder in self.live("echo"):
            (folder / "main.py").write_text(ECHO_MAIN)
            (folder / "model_inference.textproto").write_text(TEXTPROTO)
        for folder in self.live("mlp"):
            self.restore_bundle(folder)
        for folder in self.live("cxx"):
            shutil.copy(EXAMPLES / "cxx_scale" / "scale.cpp", folder / "scale.cpp")
        for folder in self.live("meta"):  # a meta model whose echo is gone stays UNAVAILABLE: give it its echo
            self.fix_meta(folder)
            echo = self.models / re.search(r"depends_on: \[(\w+)\]", (folder / "manifest.yaml").read_text()).group(1)
            if not echo.exists():
                self.write_echo(echo)
        client = triton.InferenceServerClient(self.address)
        for folder in self.live():  # unloaded by the API: loaded again
            try:
                client.load_model(folder.name)
            except InferenceServerException:
                pass
        client.close()

    # -- the clients ------------------------------------------------------------------------------
    def client(self, seed: int, http: bool = False) -> None:
        rng = random.Random(seed)
        module = triton_http if http else triton
        client = (triton_http.InferenceServerClient(self.http_address, network_timeout=60.0) if http
                  else triton.InferenceServerClient(self.address))
        options = {} if http else {"client_timeout": 60}
        while not self.stop.is_set():
            name = rng.choice([p.name for p in self.live()] + ["nonexistent"])
            infer_and_check(client, module, name, rng.randint(1, 3), seed, options, self.outcomes, self.failures)
        client.close()
        del client  # finalized on this thread: tritonclient.http's gevent hub cannot be reached from another
        gc.collect()  # (also when a reference cycle holds it: at exit its __del__ printed a gevent traceback)

    def scrape(self) -> None:
        """Read /metrics every 50 ms while models come and go: always 200 and valid Prometheus text."""
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=20) as response:
                    families = list(text_string_to_metric_families(response.read().decode()))
                if not any(f.name.startswith("nereid") for f in families):
                    self.failures.append("/metrics: no nereid metrics")
                self.outcomes["metrics scraped"] += 1
            except (OSError, ValueError) as err:
                self.failures.append(f"/metrics: {type(err).__name__}: {err}")
            time.sleep(0.05)

    # -- the run ----------------------------------------------------------------------------------
    def run(self, seconds: float) -> int:
        self.populate()
        log_path = self.root / "server.log"
        with open(log_path, "w") as log_file:
            server = subprocess.Popen([sys.executable, "-m", "nereid.cli", "serve", "--config",
                                       str(self.root / "nereid.yaml"), "--bind", self.address],
                                      stdout=log_file, stderr=subprocess.STDOUT)
        try:
            wait_until_serving(self.address)
            time.sleep(5)  # the cpp examples compile
            clients = [threading.Thread(target=self.client, args=(seed, seed >= 4)) for seed in range(6)]
            clients.append(threading.Thread(target=self.scrape))
            for thread in clients:
                thread.start()
            started = time.monotonic()
            while time.monotonic() - started < seconds and server.poll() is None:
                self.actions[self.churn_once()] += 1
                time.sleep(self.rng.uniform(0.05, 0.6))
            self.repair()
            time.sleep(4)
            self.stop.set()
            for thread in clients:
                thread.join(90)
            self.check_settled(server)
        finally:
            self.stop.set()  # also on Ctrl-C: the clients and the scraper end with the server
            stop_server(server, self.failures)
        return report({"churn": self.actions, "answers": self.outcomes}, self.failures, server, log_path)

    def check_settled(self, server: subprocess.Popen) -> None:
        if server.poll() is not None:
            self.failures.append(f"the server exited {server.returncode} during the soak")
            return
        client = triton.InferenceServerClient(self.address)
        index = {m.name: (m.state, m.reason) for m in client.get_model_repository_index().models}
        client.close()
        for folder in self.live():
            if index.get(folder.name, ("",))[0] != "READY":
                self.failures.append(f"after settling, {folder.name} is {index.get(folder.name)}")
        for name, state in index.items():
            listed = re.fullmatch(r"cxx[0-3]", name) and "folder" in state[1]  # nereid.yaml names it
            if not (self.models / name).exists() and not listed:
                self.failures.append(f"after settling, RepositoryIndex lists {name} {state}, whose folder is gone")
        children = subprocess.run(["ps", "--ppid", str(server.pid), "-o", "stat=", "-o", "pid="],
                                  capture_output=True, text=True).stdout.split("\n")
        zombies = [line for line in children if line.strip().startswith("Z")]
        if zombies:
            self.failures.append(f"zombie children of the server: {zombies}")


def infer_and_check(client, module, name: str, rows: int, seed: int, options: dict,
                    outcomes: collections.Counter, failures: list[str]) -> None:
    """One request of ``rows`` rows to ``name`` (its kind from the name), its answer checked and counted."""
    kind = name.rstrip("0123456789")
    x = np.arange(rows * WIDTH.get(kind, 4), dtype=np.float32).reshape(rows, -1) + seed
    tensor = module.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    started = time.monotonic()
    try:
        out = client.infer(name, [tensor], **options).as_numpy("output")
        if kind == "mlp":
            right = out.shape == (rows, 4)
        else:
            right = np.array_equal(out, 2 * x if kind in ("cpp", "cxx") else x)
        if not right:
            failures.append(f"{name}: wrong answer {out.tolist()} for {x.tolist()}")
        outcomes["OK"] += 1
    except InferenceServerException as err:
        status = str(err.status())
        outcomes[status] += 1
        if status not in EXPECTED:
            failures.append(f"{name}: {status} {err.message()}")
    if time.monotonic() - started > 20:
        failures.append(f"{name}: a call took {time.monotonic() - started:.1f} s")


def stop_server(server: subprocess.Popen, failures: list[str]) -> None:
    """SIGTERM, and at most 60 s for the server to stop (a failure when it does not)."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        failures.append("the server did not stop within 60 s of SIGTERM")
        server.kill()


def report(counters: dict[str, collections.Counter], failures: list[str], server: subprocess.Popen,
           log_path: Path) -> int:
    """Print the counts and each kind of failure once; the exit status (1 on any failure)."""
    for title, counts in counters.items():
        print(f"{title}:", dict(counts))
    print(f"server exit status {server.returncode}; its log: {log_path}")
    if server.returncode != 0:
        failures.append(f"the server exited {server.returncode}")
    seen = set()
    for failure in failures:
        kind = re.sub(r"(echo|cpp|cxx|meta|mlp)\d", r"\1N", failure)[:160]
        if kind not in seen:
            seen.add(kind)
            print("FAILURE", failure)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


def soak_main(soak: Callable[..., Any], description: str, prefix: str, **switches: str) -> None:
    """Parse ``--seconds``, ``--seed`` and each ``--<switch>`` (help text given), run
    ``soak(root, seed, **switches).run(seconds)`` in a new folder, and exit with its status."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--seed", type=int, default=1)
    for switch, help_text in switches.items():
        parser.add_argument(f"--{switch}", action="store_true", help=help_text)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix=prefix))
    sys.exit(soak(root, args.seed, **{switch: getattr(args, switch) for switch in switches}).run(args.seconds))


def main() -> None:
    soak_main(Soak, __doc__.splitlines()[0], "nereid-soak-")


if __name__ == "__main__":
    main()
