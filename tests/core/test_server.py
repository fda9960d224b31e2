"""The server over the wire: the health service against ServerReady, dynamic mode at start, errors echoing names.

Models are toy models (tests/toy_backends.py) and a gated toy whose load
waits until the test lets it finish, so a slow load is held exactly as long
as a test needs, with no sleeps.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc

import nereid
import toy_backends
from nereid.backend import BackendClaim, ModelContext
from nereid.hookspecs import hookimpl
from nereid.plugins import make_plugin_manager
from nereid.model_entry import FOUND_AFTER_START_REASON, NOT_LISTED_REASON
from nereid.server import NereidServer
from nereid.settings import load_settings
from support import RunningServer, expect_grpc_error, free_port, wait_until
from toy_backends import ToyModel, write_toy

HEALTH_SERVICES = ("", "inference.GRPCInferenceService")


class GatedLoads:
    """A backend (plugin name ``gated``) for folders holding ``gate.txt``: each load waits for ``gate``."""

    BACKEND_NAME = "gated"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()

    @hookimpl
    def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
        if declared or (folder / "gate.txt").is_file():
            return BackendClaim(self._create)
        return None

    def _create(self, context: ModelContext) -> ToyModel:
        plugins = self

        class GatedModel(ToyModel):
            def load(self) -> None:
                plugins.started.set()
                plugins.gate.wait(60)
                super().load()

        return GatedModel(context)


def manager(*plugins: object):
    """The built-in backends, the toy backend and ``plugins``."""
    return make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends, *plugins))


def health(server: RunningServer) -> set[str]:
    """What grpc.health.v1 answers for both services nereid registers (one value when they agree)."""
    with grpc.insecure_channel(server.url) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {health_pb2.HealthCheckResponse.ServingStatus.Name(
            stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status)
            for service in HEALTH_SERVICES}


def agrees(server: RunningServer, ready: bool) -> bool:
    """ServerReady is ``ready`` and the health service says the same."""
    return server.client.is_server_ready() is ready and health(server) == {"SERVING" if ready else "NOT_SERVING"}


def index(server: RunningServer) -> dict[str, tuple[str, str]]:
    return {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}


def test_health_list_answers_every_service_s_status_and_logs_nothing(repo, serve, caplog):
    """Found by the clients hunt: grpc.health.v1.Health/List (health.proto's, in grpcio-health-checking since 1.70)
    was left to the generated base class, which raises NotImplementedError: each call was UNIMPLEMENTED and an
    ERROR with a traceback in the log, any client able to fill the disk."""
    if not hasattr(health_pb2, "HealthListRequest"):
        pytest.skip("this grpcio-health-checking's health.proto has no List")
    write_toy(repo.models_dir, "steady")
    server = serve(repo.write_config("- name: steady\n"), manager=manager())
    assert agrees(server, True)
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(server.url) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(20):
            listed = stub.List(health_pb2.HealthListRequest(), timeout=10)
    assert {service: health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
            for service, answer in listed.statuses.items()} == dict.fromkeys(HEALTH_SERVICES, "SERVING")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_health_is_not_serving_while_a_requested_load_runs(repo, serve):
    # The health service was updated only once a RepositoryModelLoad finished: during a slow load it said
    # SERVING while ServerReady was false.
    write_toy(repo.models_dir, "steady")
    (repo.models_dir / "slow").mkdir()
    (repo.models_dir / "slow" / "gate.txt").write_text("")
    (repo.models_dir / "slow" / "model_inference.textproto").write_text(
        "input_shape: [4]\noutput_shape: [4]\nmax_batch_size: 8\n")
    plugin = GatedLoads()
    server = serve(repo.write_config("- name: steady\n"), manager=manager(plugin))
    assert agrees(server, True)
    loading = threading.Thread(target=server.client.load_model, args=("slow",))
    try:
        loading.start()
        assert plugin.started.wait(30)
        assert wait_until(lambda: agrees(server, False), 5), (server.client.is_server_ready(), health(server))
    finally:
        plugin.gate.set()
        loading.join(30)
    assert agrees(server, True)


def test_health_follows_a_rescan_that_forgets_a_failed_model(repo, serve):
    # A failed load of an unlisted folder, then the folder deleted: the next RepositoryIndex forgets it and
    # ServerReady is true again, but the health service stayed NOT_SERVING.
    write_toy(repo.models_dir, "steady")
    broken = write_toy(repo.models_dir, "broken")
    (broken / "fail.txt").write_text("weights are corrupt")
    server = serve(repo.write_config("- name: steady\n"), manager=manager())
    expect_grpc_error("INTERNAL", lambda: server.client.load_model("broken"), "weights are corrupt")
    assert agrees(server, False)
    shutil.rmtree(broken)
    assert "broken" not in index(server)
    assert agrees(server, True)


def test_each_change_of_readiness_is_logged_with_what_holds_it_back(repo, serve, caplog):
    """The operator hunt: no line said the server had become ready, or why it was not."""
    write_toy(repo.models_dir, "steady")
    broken = write_toy(repo.models_dir, "broken")
    (broken / "fail.txt").write_text("weights are corrupt")
    caplog.set_level(logging.INFO, "nereid.server")
    server = serve(repo.write_config("- name: steady\n"), manager=manager())
    assert "server ready (ServerReady, /v2/health/ready and the gRPC health service say so)" in caplog.messages
    expect_grpc_error("INTERNAL", lambda: server.client.load_model("broken"), "weights are corrupt")
    assert "server not ready: model(s) not READY: 'broken' LOADING" in caplog.messages  # (its load began)
    # The operator hunt: that LOADING line stayed the last word after the load ended; once it has, it is said again.
    assert caplog.messages.count("server still not ready: model(s) not READY: 'broken' UNAVAILABLE") == 1
    expect_grpc_error("INTERNAL", lambda: server.client.load_model("broken"), "weights are corrupt")
    assert caplog.messages.count("server still not ready: model(s) not READY: 'broken' UNAVAILABLE") == 1, \
        "said again though nothing changed"


@pytest.mark.parametrize("watch", [False, True])
def test_a_repository_without_model_folders_serves_ready_and_says_it_serves_nothing(repo, serve, caplog, watch):
    """The CLI hunt: an empty volume mount or a typo in ml_backends_path served nothing, ready, unsaid."""
    caplog.set_level(logging.INFO, "nereid.server")
    server = serve(repo.write_config(server_extra="  watch: true\n" if watch else ""), manager=manager())
    assert server.client.is_server_ready()
    until = " until one is copied in (server.watch)" if watch else ""
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"no model folders in {repo.models_dir}: the server is ready and serves no model{until}"]


def test_a_folder_added_after_the_start_without_a_models_key_or_a_watch_says_so(repo, serve):
    """Found by a bug hunt: it said "not listed in nereid.yaml", of a nereid.yaml that lists nothing (with no
    models: key every folder loads at start)."""
    write_toy(repo.models_dir, "steady")
    server = serve(repo.write_config(), manager=manager())
    write_toy(repo.models_dir, "later")
    assert index(server)["later"] == ("UNAVAILABLE", f"{FOUND_AFTER_START_REASON}; load it with RepositoryModelLoad")
    server.client.load_model("later")
    assert index(server)["later"] == ("READY", "")


def test_an_unlisted_folder_present_at_start_waits_for_a_load_in_dynamic_mode(repo, serve, caplog):
    # Dynamic mode loads folders dropped in while serving; an unlisted folder that was there at start is
    # not loaded (exactly the listed models load at start). It claimed "it loads once it has been
    # unchanged for server.watch_settle_ms" and never did.
    caplog.set_level(logging.INFO, "nereid.server")
    write_toy(repo.models_dir, "steady")
    write_toy(repo.models_dir, "extra")
    server = serve(repo.write_config("- name: steady\n", server_extra="  watch: true\n  watch_settle_ms: 50\n"),
                   manager=manager())
    time.sleep(0.5)  # ten settle times: had the watcher been going to load it, it would have
    assert index(server)["extra"] == ("UNAVAILABLE", f"{NOT_LISTED_REASON}; load it with RepositoryModelLoad")
    # Said at start, too: a folder dropped in under a watch is not loaded by the next start.
    assert "not listed in nereid.yaml, so not loaded: 'extra' (RepositoryModelLoad loads one)" in caplog.messages
    assert agrees(server, True)
    server.client.load_model("extra")
    assert index(server)["extra"] == ("READY", "")
    write_toy(repo.models_dir, "dropped")  # dropped in while serving: it loads by itself
    assert wait_until(lambda: index(server).get("dropped", ("",))[0] == "READY", 20)


def test_not_found_echoes_the_clients_name_as_sent(repo, serve):
    # The path scrubbing of error messages rewrote the client's own name: a name starting with
    # ml_backends_path answered "unknown model 'python_rowsum'" (another, existing model), and one under
    # nereid's install folder "<nereid>/...", which told a client which absolute paths were real.
    write_toy(repo.models_dir, "python_rowsum")
    broken = write_toy(repo.models_dir, "broken")
    (broken / "fail.txt").write_text("weights are corrupt")
    server = serve(repo.write_config("- name: python_rowsum\n"), manager=manager())
    names = [f"{repo.models_dir}/python_rowsum", f"{repo.models_dir.resolve()}/python_rowsum",
             f"{Path(nereid.__file__).resolve().parent}/anything", f"{server.server.scratch_dir}/x"]
    for name in names:
        expect_grpc_error("NOT_FOUND", lambda: server.client.get_model_metadata(name), f"unknown model '{name}'")
        expect_grpc_error("NOT_FOUND", lambda: server.client.get_model_config(name), f"unknown model '{name}'")
    # Text the server writes is still scrubbed (the toy names its fail.txt by its absolute path).
    message = expect_grpc_error("INTERNAL", lambda: server.client.load_model("broken"),
                                "failed to load model 'broken': broken/fail.txt: weights are corrupt")
    assert str(repo.models_dir) not in message and str(repo.models_dir.resolve()) not in message


def taken_port() -> socket.socket:
    """A socket listening on 127.0.0.1 (SO_REUSEADDR, as servers set it): its port is in use."""
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken


def failed_start(config: Path, **kwargs: object) -> tuple[NereidServer, str]:
    """A NereidServer whose start fails with an OSError; it and the error's text."""
    server = NereidServer(load_settings(config), manager(), **kwargs)
    with pytest.raises(OSError) as caught:
        asyncio.run(server.start())
    return server, str(caught.value)


def refused(port: int) -> bool:
    """Nothing listens on 127.0.0.1:``port`` any more."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_failed_start_closes_what_it_opened_and_removes_its_scratch_folder(repo):
    # `nereid serve` exiting 1 on a port in use left its /tmp/nereid-<pid>-... scratch folder behind.
    write_toy(repo.models_dir, "steady")
    grpc_port = free_port()
    with taken_port() as taken:
        config = repo.write_config("- name: steady\n")
        http_addr = f"127.0.0.1:{taken.getsockname()[1]}"
        config.write_text(config.read_text().replace('bind_addr: "127.0.0.1:0"', f'bind_addr: "127.0.0.1:{grpc_port}"')
                          .replace('http_addr: "127.0.0.1:0"', f'http_addr: "{http_addr}"'))
        server, error = failed_start(config)
    assert error == f"cannot listen on {http_addr} (server.http_addr): Address already in use"
    assert not server.scratch_dir.exists()
    # gRPC's port and the metrics endpoint were open when HTTP failed: both are closed again.
    assert server.metrics_port is not None and refused(server.metrics_port) and refused(grpc_port)


def test_a_grpc_address_in_use_is_one_line_with_the_reason_naming_where_the_address_came_from(repo, capfd):
    # gRPC's core printed "E... add_port.cc:83] Failed to add port to server" first, nereid's line gave no
    # reason ("Failed to bind to address"), and an address given with --bind was blamed on server.bind_addr.
    write_toy(repo.models_dir, "steady")
    with taken_port() as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        config = repo.write_config("- name: steady\n", metrics_addr="")
        flag_server, flag_error = failed_start(config, bind_addr=address)
        config.write_text(config.read_text().replace('bind_addr: "127.0.0.1:0"', f'bind_addr: "{address}"'))
        yaml_server, yaml_error = failed_start(config)
    assert flag_error == f"cannot listen on {address} (--bind): Address already in use"
    assert yaml_error == f"cannot listen on {address} (server.bind_addr): Address already in use"
    assert "add_port" not in capfd.readouterr().err
    assert not flag_server.scratch_dir.exists() and not yaml_server.scratch_dir.exists()
    # The HTTP listener, opened before gRPC binds, on gRPC's own address: gRPC's core line was back. (Spelled
    # otherwise: the same spelling is refused as settings are read.)
    port = free_port()
    config.write_text(config.read_text().replace(f'bind_addr: "{address}"', f'bind_addr: "127.0.0.1:{port}"')
                      .replace('http_addr: "127.0.0.1:0"', f'http_addr: "localhost:{port}"'))
    _, shared_error = failed_start(config)
    assert shared_error == f"cannot listen on 127.0.0.1:{port} (server.bind_addr): Address already in use"
    assert "add_port" not in capfd.readouterr().err


def test_a_start_removes_dead_servers_scratch_folders_from_tmpdir_though_tempfile_chose_another(repo, tmp_path,
                                                                                              monkeypatch):
    """Dead servers' folders filling TMPDIR made tempfile pass it over, and the start then looked for dead
    servers' folders only where tempfile had gone: the ones filling TMPDIR stayed for good."""
    import os

    from nereid.leftovers import remove_scratch_folder

    tmpdir = tmp_path / "tmpdir"
    dead = tmpdir / "nereid-999999999-left"  # no process has that pid, and no one holds its lock
    dead.mkdir(parents=True)
    os.utime(dead, (time.time() - 3600, time.time() - 3600))
    monkeypatch.setenv("TMPDIR", str(tmpdir))  # tempfile's choice, made before, stays where it is
    server = NereidServer(load_settings(repo.write_config()), manager())
    try:
        assert not dead.exists()
    finally:
        remove_scratch_folder(server.scratch_dir)


class BlockingAsyncModels:
    """A backend (plugin name ``blocking``) for folders holding ``blocks.txt``: an ``async def infer`` that
    calls ``time.sleep`` for that many seconds, holding the event loop as a careless plugin would."""

    BACKEND_NAME = "blocking"

    @hookimpl
    def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
        if (folder / "blocks.txt").is_file():
            return BackendClaim(BlockingAsyncModel)
        return None


class BlockingAsyncModel(ToyModel):
    async def infer(self, inputs):
        time.sleep(float((self.context.folder / "blocks.txt").read_text()))
        return ToyModel.infer(self, inputs)


def test_an_async_infer_that_blocks_the_event_loop_is_named_in_the_log_while_it_blocks(repo, serve, caplog):
    # It stalls every model and client, and nothing said so: the requests merely got slow.
    caplog.set_level(logging.WARNING, "nereid.loop")
    careless = write_toy(repo.models_dir, "careless")
    (careless / "toy.txt").rename(careless / "blocks.txt")
    (careless / "blocks.txt").write_text("1.8")
    server = serve(repo.write_config("- name: careless\n"), manager=manager(BlockingAsyncModels()))
    tensor = triton.InferInput("input", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 4), np.float32))
    np.testing.assert_array_equal(server.client.infer("careless", [tensor]).as_numpy("output"), np.ones((1, 4)))
    assert wait_until(lambda: len(caplog.records) == 2, 5)
    held, again = (record.getMessage() for record in caplog.records)
    assert re.match(r"the event loop has been held for 1\.\d s by one callback", held), held
    assert held.endswith(f"{__file__}:{BlockingAsyncModel.infer.__code__.co_firstlineno + 1} in infer"), held
    assert again.startswith("the event loop runs again after 1.")
    # The server serves on.
    assert server.client.is_server_live()


def test_a_burst_of_calls_larger_than_grpcs_default_pending_limit_is_answered_whole(repo, serve):
    """Found by the complexity hunt: grpcio's asyncio server takes new calls one at a time, and gRPC's core
    answered those past its default limit of calls not yet taken (about 1,000 to 3,000) CANCELLED before nereid
    saw them, counted nowhere; a bare grpcio server does the same. The server lifts the limit."""
    write_toy(repo.models_dir, "steady")
    server = serve(repo.write_config("- name: steady\n"), manager=manager())

    async def burst(calls: int) -> dict[str, int]:
        codes: dict[str, int] = {}
        async with grpc.aio.insecure_channel(server.url) as channel:
            live = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")  # (bytes in, bytes out)

            async def one() -> None:
                try:
                    await live(b"", timeout=120)
                    code = "OK"
                except grpc.aio.AioRpcError as err:
                    code = err.code().name
                codes[code] = codes.get(code, 0) + 1
            await asyncio.gather(*(one() for _ in range(calls)))
        return codes

    assert asyncio.run(burst(4000)) == {"OK": 4000}
