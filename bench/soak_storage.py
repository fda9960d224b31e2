"""Soak: a repository in a bucket changed under load; every request and every load must end as it should.

One ``nereid serve`` reads its models from ``s3://models/soak`` on a moto
server (tests/moto_s3.py) and serves python echo models, ``mlp_bundle``
copies and meta models that call an echo, while four gRPC clients call random
names. Every 0.05-0.4 s (seeded) the bucket or the server is changed:

- objects replaced: ``main.py`` edited, broken and fixed; textprotos broken and
  fixed; bundle weights and programs truncated and restored; meta
  ``model.py`` broken and fixed;
- model prefixes copied, deleted (every object) and half-deleted;
- faults armed on the next GETs of a weights file (a 500, or half the range);
- RepositoryModelLoad (which fetches the changed objects), RepositoryModelUnload
  and RepositoryIndex (which lists the bucket again) on random names.

A request may be answered OK (checked), NOT_FOUND or UNAVAILABLE; a load may
succeed or fail with INTERNAL naming the reason. Anything else is a failure,
as is a call over 20 s. At the end the bucket is repaired and every model
loaded once more: each must be READY; once the models whose prefix went are
unloaded (a loaded model serves until then), RepositoryIndex must list exactly
the prefixes in the bucket; each model's cached folder must hold exactly its small
objects as the bucket has them (no weights), and the server must stop cleanly
on SIGTERM.

    python3 bench/soak_storage.py [--seconds 60] [--seed 1] [--watch]

With ``--watch`` the server also follows the bucket by itself (``server.watch``,
polled every 0.3 s): then models whose prefix went must have left the index
without being unloaded through the API.

Exits 1 on a failure, printing each kind once.
"""

from __future__ import annotations

import collections
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import obstore  # noqa: E402

from common import free_port, wait_until_serving  # noqa: E402
from moto_s3 import BUCKET, bucket_state, start_server, upload_folder  # noqa: E402
from soak_repository import (BROKEN_MAIN, ECHO_MAIN, EXAMPLES, EXPECTED, META_MANIFEST, META_MODEL,  # noqa: E402
                             TEXTPROTO, infer_and_check, report, soak_main, stop_server)

PREFIX = "soak"
WATCH_YAML = "  watch: true\n  watch_poll_s: 0.3\n  watch_settle_ms: 300\n"
SERVER_YAML = (f'server:\n  ml_backends_path: "s3://{BUCKET}/{PREFIX}"\n  cache_dir: "{{cache}}"\n'
               '  metrics_addr: ""\n  http_addr: ""\n  repository_control: true\n')


class StorageSoak:
    def __init__(self, root: Path, seed: int, watch: bool = False) -> None:
        self.root = root
        self.watch = watch
        self.rng = random.Random(seed)
        self.address = f"127.0.0.1:{free_port()}"
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.loads: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self.actions: collections.Counter[str] = collections.Counter()
        self.stop = threading.Event()
        self.s3, self.moto, _ = start_server()
        self.s3.prefix = PREFIX
        self.store = self.s3.store

    # -- the bucket -------------------------------------------------------------------------------
    def put(self, key: str, data: bytes | str) -> None:
        obstore.put(self.store, f"{PREFIX}/{key}", data.encode() if isinstance(data, str) else data)

    def models(self, kind: str = "") -> list[str]:
        names = {key.split("/")[1] for key in bucket_state(self.store, PREFIX)}
        return sorted(n for n in names if not kind or n.rstrip("0123456789") == kind)

    def write_echo(self, name: str, main: str = ECHO_MAIN) -> None:
        self.put(f"{name}/model_inference.textproto", TEXTPROTO)
        self.put(f"{name}/main.py", main)

    def write_mlp(self, name: str) -> None:
        upload_folder(self.store, EXAMPLES / "mlp_bundle", f"{PREFIX}/{name}")

    def write_meta(self, name: str, echo: str, style: str = "async") -> None:
        self.put(f"{name}/manifest.yaml", META_MANIFEST.format(echo=echo))
        self.put(f"{name}/model.py", META_MODEL[style].replace("{echo}", echo))

    def meta_echo(self, name: str) -> str:
        """The echo a meta model calls (echo0 when a half-delete took its manifest)."""
        try:
            manifest = bytes(obstore.get(self.store, f"{PREFIX}/{name}/manifest.yaml").bytes()).decode()
        except FileNotFoundError:
            return "echo0"
        return re.search(r"depends_on: \[(\w+)\]", manifest).group(1)

    def delete(self, name: str, share: float = 1.0) -> None:
        keys = sorted(k for k in bucket_state(self.store, f"{PREFIX}/{name}/"))
        for key in keys[:max(1, int(len(keys) * share))]:
            obstore.delete(self.store, key)

    def populate(self) -> None:
        for index in range(3):
            self.write_echo(f"echo{index}")
        self.write_mlp("mlp0")
        self.write_mlp("mlp1")
        self.write_meta("meta0", "echo0", "async")
        self.write_meta("meta1", "echo1", "sync")

    def churn_once(self) -> str:
        rng = self.rng
        kind = rng.choice(["echo_add", "echo_edit", "echo_break", "echo_fix", "textproto", "mlp_copy",
                           "mlp_break", "mlp_fix", "meta_add", "meta_break", "meta_fix", "delete", "half_delete",
                           "fault", "load", "load", "load", "unload", "index"])
        echoes, mlps, metas = self.models("echo"), self.models("mlp"), self.models("meta")
        if kind == "echo_add":
            self.write_echo(f"echo{rng.randint(0, 5)}")
        elif kind in ("echo_edit", "echo_break", "echo_fix") and echoes:
            main = {"echo_edit": ECHO_MAIN + f"# {rng.random()}\n", "echo_break": BROKEN_MAIN,
                    "echo_fix": ECHO_MAIN}[kind]
            self.put(f"{rng.choice(echoes)}/main.py", main)
        elif kind == "textproto" and echoes:
            self.put(f"{rng.choice(echoes)}/model_inference.textproto",
                     "input_shape: [oops\n" if rng.random() < 0.5 else TEXTPROTO)
        elif kind == "mlp_copy":
            self.write_mlp(f"mlp{rng.randint(0, 3)}")
        elif kind == "mlp_break" and mlps:
            name = rng.choice(mlps)
            file = rng.choice(["weights.safetensors", "model.b1.mlir", "model.b8.mlir"])
            data = (EXAMPLES / "mlp_bundle" / file).read_bytes()
            self.put(f"{name}/{file}", data[:rng.randint(0, len(data))])
        elif kind == "mlp_fix" and mlps:
            self.write_mlp(rng.choice(mlps))
        elif kind == "meta_add":
            self.write_meta(f"meta{rng.randint(0, 5)}", f"echo{rng.randint(0, 5)}", rng.choice(["async", "sync"]))
        elif kind in ("meta_break", "meta_fix") and metas:
            name = rng.choice(metas)
            if kind == "meta_break":
                self.put(f"{name}/model.py", BROKEN_MAIN)
            else:
                self.write_meta(name, self.meta_echo(name))
        elif kind in ("delete", "half_delete") and len(self.models()) > 3:
            self.delete(rng.choice(self.models()), 1.0 if kind == "delete" else 0.5)
        elif kind == "fault" and mlps:
            self.s3.fail(f"{rng.choice(mlps)}/weights.safetensors", times=rng.randint(1, 6),
                         kind=rng.choice(["error", "short"]))
        elif kind in ("load", "unload", "index"):
            self.control(kind, rng.choice(self.models() + ["nonexistent"]))
        return kind

    def control(self, kind: str, name: str) -> None:
        client = triton.InferenceServerClient(self.address)
        try:
            if kind == "index":
                client.get_model_repository_index()
            elif kind == "load":
                client.load_model(name)
                self.loads["loaded"] += 1
            else:
                client.unload_model(name)
        except InferenceServerException as err:
            status = str(err.status())
            self.loads[f"{kind} {status}"] += 1
            # A load fails with INTERNAL and its reason (as Triton's does); an unknown name is NOT_FOUND.
            if status not in EXPECTED and not (kind == "load" and status == "StatusCode.INTERNAL"
                                               and "failed to load" in err.message()):
                self.failures.append(f"{kind} {name}: {status} {err.message()}")
        finally:
            client.close()

    def repair(self) -> None:
        for name in self.models("echo"):  # half-deleted ones too: any object left lists the folder
            self.write_echo(name)
        for name in self.models("mlp"):
            self.write_mlp(name)
        for name in self.models("meta"):
            echo = self.meta_echo(name)
            self.write_meta(name, echo)
            self.write_echo(echo)
        with self.s3.lock:
            self.s3.faults.clear()

    # -- the clients ------------------------------------------------------------------------------
    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        client = triton.InferenceServerClient(self.address)
        names: list[str] = []
        while not self.stop.is_set():
            if rng.random() < 0.05 or not names:
                names = self.models() + ["nonexistent"]  # listing the bucket every call would load moto
            infer_and_check(client, triton, rng.choice(names), rng.randint(1, 3), seed, {"client_timeout": 60},
                            self.outcomes, self.failures)
        client.close()

    # -- the run ----------------------------------------------------------------------------------
    def run(self, seconds: float) -> int:
        self.populate()
        cache = self.root / "cache"
        config = self.root / "nereid.yaml"
        config.write_text(SERVER_YAML.format(cache=cache) + (WATCH_YAML if self.watch else ""))
        log_path = self.root / "server.log"
        with open(log_path, "w") as log_file:
            server = subprocess.Popen([sys.executable, "-m", "nereid.cli", "serve", "--config", str(config),
                                       "--bind", self.address], stdout=log_file, stderr=subprocess.STDOUT,
                                      env={**os.environ, **self.s3.env()})
        try:
            wait_until_serving(self.address)
            clients = [threading.Thread(target=self.client, args=(seed,)) for seed in range(4)]
            for thread in clients:
                thread.start()
            started = time.monotonic()
            while time.monotonic() - started < seconds and server.poll() is None:
                self.actions[self.churn_once()] += 1
                time.sleep(self.rng.uniform(0.05, 0.4))
            self.stop.set()
            for thread in clients:
                thread.join(90)
            self.repair()
            for name in self.models():
                self.control("load", name)
            if self.watch:
                time.sleep(3)  # the watcher's polls catch up with the repair
            self.check_settled(server, cache)
        finally:
            self.stop.set()
            stop_server(server, self.failures)
            self.moto.shutdown()
        return report({"churn": self.actions, "answers": self.outcomes, "repository control": self.loads},
                      self.failures, server, log_path)

    def check_settled(self, server: subprocess.Popen, cache: Path) -> None:
        if server.poll() is not None:
            self.failures.append(f"the server exited {server.returncode} during the soak")
            return
        client = triton.InferenceServerClient(self.address)
        present = set(self.models())
        # A loaded model whose prefix went keeps serving (and its entry) until it is unloaded, unless the
        # server follows the bucket: then it is gone already.
        for model in client.get_model_repository_index().models:
            if model.name not in present and model.state == "READY" and not self.watch:
                client.unload_model(model.name)
        index = {m.name: (m.state, m.reason) for m in client.get_model_repository_index().models}
        client.close()
        for name in present:
            if index.get(name, ("",))[0] != "READY":
                self.failures.append(f"after the repair, {name} is {index.get(name)}")
        for name, state in index.items():
            if name not in present:
                self.failures.append(f"after the repair, RepositoryIndex lists {name} {state}, whose prefix is gone")
        for name in present:
            self.check_mirror(name, cache)

    def check_mirror(self, name: str, cache: Path) -> None:
        """The model's cached folder holds exactly its small objects, each as the bucket has it now."""
        folders = list(cache.glob(f"repositories/*/{name}"))
        if len(folders) != 1:
            self.failures.append(f"after the repair, {name} has {len(folders)} cached folder(s)")
            return
        objects = {key.split("/", 2)[2]: key for key in bucket_state(self.store, f"{PREFIX}/{name}/")}
        streamed = "manifest.yaml" in objects  # a bundle's weights are never written locally
        expected = {relative for relative in objects if not (streamed and relative.endswith(".safetensors"))}
        local = {p.relative_to(folders[0]).as_posix() for p in folders[0].rglob("*")
                 if p.is_file() and not p.relative_to(folders[0]).as_posix().startswith(".")}
        if local != expected:
            self.failures.append(f"after the repair, {name}'s cached folder holds {sorted(local)}, "
                                 f"the bucket {sorted(expected)}")
        for relative in expected & local:
            remote = bytes(obstore.get(self.store, objects[relative]).bytes())
            if (folders[0] / relative).read_bytes() != remote:
                self.failures.append(f"after the repair, {name}/{relative} in the cache differs from the bucket's")


def main() -> None:
    soak_main(StorageSoak, __doc__.splitlines()[0], "nereid-soak-storage-",
              watch="the server follows the bucket by itself (server.watch, polled every 0.3 s)")


if __name__ == "__main__":
    main()
