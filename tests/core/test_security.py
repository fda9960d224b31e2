"""The security settings, against real servers: TLS and mutual TLS on the gRPC and HTTP listeners
(certificates made here with ``cryptography``), server.repository_control, server.max_message_bytes,
symlinks leaving the repository, server paths kept off the wire, and SIGTERM while a model loads."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import gevent.ssl
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as triton_http
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tritonclient.utils import InferenceServerException

from nereid.dataplane import DataPlane
from nereid.errors import ConfigError, PermissionDenied
from nereid.plugins import make_plugin_manager
from nereid.protocol.http_listener import HttpListener
from nereid.repository import ModelRepository
from nereid.settings import DEFAULT_MAX_MESSAGE_BYTES, ServerSettings, load_settings, repository_control_allowed
from nereid.tls import TlsSettings, ssl_context
from support import NEREID, expect_grpc_error, free_port, process_alive, textproto_single, wait_until


# --------------------------------------------------------------------------- certificates


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(folder: Path, name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, Path]:
    """A self-signed CA; returns its key, certificate and the certificate's PEM path."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    path = folder / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, path


def make_leaf(folder: Path, name: str, ca_key, ca_cert: x509.Certificate) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 / localhost signed by the CA; returns (cert path, key path)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture
def pki(tmp_path):
    """A CA, a server certificate, a client certificate from that CA, and one from another CA."""
    folder = tmp_path / "pki"
    folder.mkdir()
    ca_key, ca_cert, ca_path = make_ca(folder, "nereid-test-ca")
    server_cert, server_key = make_leaf(folder, "server", ca_key, ca_cert)
    client_cert, client_key = make_leaf(folder, "client", ca_key, ca_cert)
    other_key, other_cert, _ = make_ca(folder, "other-ca")
    rogue_cert, rogue_key = make_leaf(folder, "rogue", other_key, other_cert)
    return {"ca": ca_path, "server_cert": server_cert, "server_key": server_key, "client_cert": client_cert,
            "client_key": client_key, "rogue_cert": rogue_cert, "rogue_key": rogue_key, "folder": folder,
            "ca_key": ca_key, "ca_cert": ca_cert}


def tls_client(server, pki, cert: str | None = None) -> triton.InferenceServerClient:
    kwargs = {}
    if cert is not None:
        kwargs = {"certificate_chain": str(pki[f"{cert}_cert"]), "private_key": str(pki[f"{cert}_key"])}
    return triton.InferenceServerClient(server.url, ssl=True, root_certificates=str(pki["ca"]), **kwargs)


def tls_yaml(pki, client_ca: bool = False) -> str:
    text = f'  tls:\n    cert: "{pki["server_cert"]}"\n    key: "{pki["server_key"]}"\n'
    return text + (f'    client_ca: "{pki["ca"]}"\n' if client_ca else "")


def live(client: triton.InferenceServerClient) -> bool:
    try:
        return client.is_server_live(client_timeout=5)
    finally:
        client.close()


# --------------------------------------------------------------------------- TLS


def test_tls_serves_tls_clients_and_refuses_plaintext(repo, serve, pki):
    repo.python("echo")
    server = serve(repo.write_config(server_extra=tls_yaml(pki)))
    server.client.close()
    assert live(tls_client(server, pki))
    with pytest.raises(InferenceServerException):
        live(triton.InferenceServerClient(server.url))  # plaintext to a TLS port


def test_mutual_tls_refuses_clients_without_a_certificate_from_the_client_ca(repo, serve, pki, caplog):
    repo.python("echo")
    caplog.set_level(logging.INFO, "nereid.server")
    server = serve(repo.write_config(server_extra=tls_yaml(pki, client_ca=True)))
    server.client.close()
    # Both listeners' start lines say what a client must speak (the security hunt: the REST line did not).
    http_line = f"KServe V2 REST on {server.server.http_addr.rpartition(':')[0]}:{server.server.http_port} (mutual TLS)"
    assert http_line in caplog.text and "(mutual TLS, repository control" in caplog.text, caplog.text
    assert live(tls_client(server, pki, cert="client"))
    with pytest.raises(InferenceServerException):
        live(tls_client(server, pki))  # no client certificate
    with pytest.raises(InferenceServerException):
        live(tls_client(server, pki, cert="rogue"))  # signed by another CA


def test_a_renewed_certificate_on_disk_is_served_to_new_connections(repo, serve, pki):
    repo.python("echo")
    server = serve(repo.write_config(server_extra=tls_yaml(pki)))
    server.client.close()
    assert live(tls_client(server, pki))
    # Renew: a new CA and a server certificate from it, written over the configured files.
    new_key, new_cert, new_ca = make_ca(pki["folder"], "renewed-ca")
    renewed_cert, renewed_key = make_leaf(pki["folder"], "renewed", new_key, new_cert)
    os.replace(renewed_key, pki["server_key"])
    os.replace(renewed_cert, pki["server_cert"])
    renewed_client = triton.InferenceServerClient(server.url, ssl=True, root_certificates=str(new_ca))
    assert live(renewed_client)


def https_live(server, ca: Path, cert: tuple[Path, Path] | None = None) -> bool:
    """GET /v2/health/live over HTTPS on a new connection, trusting ``ca`` (urllib, as curl would)."""
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(*cert)
    url = f"https://127.0.0.1:{server.server.http_port}/v2/health/live"
    with urllib.request.urlopen(url, context=context, timeout=10) as response:
        return response.status == 200


@pytest.mark.filterwarnings("ignore:ssl.match_hostname:DeprecationWarning")  # geventhttpclient's own call
def test_https_serves_tritonclient_and_refuses_plaintext(repo, serve, pki):
    repo.python("echo")
    server = serve(repo.write_config(server_extra=tls_yaml(pki)))
    client = triton_http.InferenceServerClient(
        f"localhost:{server.server.http_port}", ssl=True,
        ssl_context_factory=lambda: gevent.ssl.create_default_context(cafile=str(pki["ca"])))
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    tensor = triton_http.InferInput("input", [1, 4], "FP32")
    tensor.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("echo", [tensor]).as_numpy("output"), x)
    client.close()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{server.server.http_port}/v2/health/live", timeout=10)


def test_https_mutual_tls_refuses_clients_without_a_certificate_from_the_client_ca(repo, serve, pki):
    repo.python("echo")
    server = serve(repo.write_config(server_extra=tls_yaml(pki, client_ca=True)))
    assert https_live(server, pki["ca"], (pki["client_cert"], pki["client_key"]))
    for cert in (None, (pki["rogue_cert"], pki["rogue_key"])):  # none, or one signed by another CA
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            https_live(server, pki["ca"], cert)


def test_https_serves_a_renewed_certificate_to_new_connections_and_keeps_it_through_a_bad_one(
        repo, serve, pki, caplog):
    repo.python("echo")
    server = serve(repo.write_config(server_extra=tls_yaml(pki, client_ca=True)))
    client = (pki["client_cert"], pki["client_key"])
    assert https_live(server, pki["ca"], client)
    old_ca = pki["folder"] / "old-ca.pem"
    old_ca.write_bytes(pki["ca"].read_bytes())
    # Renewed by a new CA, which now also signs the clients: all three files are replaced on disk.
    new_key, new_cert, new_ca = make_ca(pki["folder"], "renewed-ca")
    renewed_cert, renewed_key = make_leaf(pki["folder"], "renewed", new_key, new_cert)
    new_client = make_leaf(pki["folder"], "new-client", new_key, new_cert)
    os.replace(renewed_key, pki["server_key"])
    os.replace(renewed_cert, pki["server_cert"])
    os.replace(new_ca, pki["ca"])
    assert https_live(server, pki["ca"], new_client)
    with pytest.raises(urllib.error.URLError):
        https_live(server, old_ca, new_client)  # the old certificate is no longer served...
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        https_live(server, pki["ca"], client)  # ...and clients of the old CA are no longer let in
    # A key that does not parse is refused by name, and the renewed certificate stays in use.
    pki["server_key"].write_text("not a key\n")
    assert https_live(server, pki["ca"], new_client)
    assert "server.tls.key changed but cannot be used" in caplog.text


def test_stopping_https_is_prompt_with_an_idle_keep_alive_client_and_lets_requests_in_flight_finish(pki, caplog):
    """An idle keep-alive HTTPS client that never sends close_notify held the stop for the whole grace
    (asyncio waits for it up to 30 s), ending with uvicorn's ERROR 'timeout graceful shutdown exceeded'."""
    big = 8 << 20
    slow_began = threading.Event()

    async def app(scope, receive, send):
        slow = scope["path"] == "/slow"
        if slow:
            slow_began.set()
            await asyncio.sleep(0.5)
        body = b"x" * big if slow else b"ok"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def read_answer(conn: ssl.SSLSocket) -> bytes:
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += conn.recv(65536)
        head, body = answer.split(b"\r\n\r\n", 1)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(body) < length and (chunk := conn.recv(65536)):
            body += chunk
        return body

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    listener = HttpListener(app, ssl_context(TlsSettings(pki["server_cert"], pki["server_key"])), grace_s=20)
    port = asyncio.run_coroutine_threadsafe(listener.start("127.0.0.1:0"), loop).result(10)
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    # Raw TLS connections: closing them without close_notify is up to this test.
    idle = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="localhost")
    busy = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="localhost")
    try:
        idle.sendall(b"GET / HTTP/1.1\r\nhost: localhost\r\n\r\n")
        assert read_answer(idle) == b"ok"  # and now idle, kept alive, never closed
        busy.sendall(b"GET /slow HTTP/1.1\r\nhost: localhost\r\n\r\n")
        assert slow_began.wait(10)  # in flight
        stopped = asyncio.run_coroutine_threadsafe(listener.stop(), loop)
        time.sleep(0.6)  # the answer is ready by now, and read slowly: 8 MiB wait in the server's buffers
        assert read_answer(busy) == b"x" * big  # the request in flight finished, whole
        read = time.monotonic()
        stopped.result(30)
        # Timed from the answer's last byte: the defect waited out the grace after it, where the 8 MiB TLS read
        # itself (CPU work of this test's) took 4-8 s at nice 19 beside busy loops (the flaky-test hunt).
        after_read = time.monotonic() - read
        assert after_read < 5, f"the stop ended {after_read:.1f} s after the last answer was read (grace 20 s)"
        assert idle.recv(100) == b""  # closed by the server (its close_notify)
        assert "timeout graceful shutdown exceeded" not in caplog.text
    finally:
        idle.close()
        busy.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.parametrize("broken, key", [("missing_cert", "cert"), ("garbage_key", "key"),
                                         ("mismatched_key", "key"), ("garbage_ca", "client_ca")])
def test_bad_tls_files_stop_serve_and_check_naming_the_key(repo, pki, broken, key):
    repo.python("echo")
    files = {"cert": pki["server_cert"], "key": pki["server_key"], "client_ca": pki["ca"]}
    if broken == "missing_cert":
        files["cert"] = pki["folder"] / "nope.crt"
    elif broken == "garbage_key":
        files["key"] = pki["folder"] / "garbage.key"
        files["key"].write_text("not a key\n")
    elif broken == "mismatched_key":
        files["key"] = pki["client_key"]
    else:
        files["client_ca"] = pki["folder"] / "garbage.pem"
        files["client_ca"].write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    extra = "  tls:\n" + "".join(f'    {k}: "{v}"\n' for k, v in files.items())
    config = repo.write_config(server_extra=extra)
    with pytest.raises(ConfigError, match=rf"nereid.yaml: server.tls.{key}: "):
        load_settings(config)
    if broken != "missing_cert":
        return  # the commands report any ConfigError alike: one case runs them
    for command in ("check", "serve"):
        result = subprocess.run([sys.executable, "-m", "nereid.cli", command, "--config", str(config)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert f"server.tls.{key}:" in result.stderr


# --------------------------------------------------------------------------- repository control, limits


def test_repository_control_off_refuses_load_and_unload(repo, serve):
    repo.python("echo")
    server = serve(repo.write_config(server_extra="  repository_control: false\n"))
    for call, rpc in ((server.client.unload_model, "RepositoryModelUnload"),
                      (server.client.load_model, "RepositoryModelLoad")):
        expect_grpc_error("PERMISSION_DENIED", lambda: call("echo"),
                          f"model 'echo': {rpc} is turned off on this server (server.repository_control: false)")
    assert server.client.is_model_ready("echo")  # nothing was unloaded


def test_with_repository_control_off_no_answer_advises_a_load_and_the_refusal_names_its_cause(repo, serve, caplog):
    """Defects: with repository control off, RepositoryIndex still told clients to "load it with
    RepositoryModelLoad", which was then refused, and the refusal blamed the default for non-loopback addresses
    when the key was set (and the addresses were loopback)."""
    caplog.set_level(logging.INFO, "nereid.server")
    repo.python("echo")
    repo.python("extra")
    server = serve(repo.write_config("- name: echo\n", server_extra="  repository_control: false\n"))
    (extra,) = [model for model in server.client.get_model_repository_index().models if model.name == "extra"]
    assert (extra.state, extra.reason) == ("UNAVAILABLE", "not listed in nereid.yaml")
    assert "not listed in nereid.yaml, so not loaded: 'extra' (list one under models: to serve it; " \
           "RepositoryModelLoad is off)" in caplog.messages
    # Unset, on a public address: the refusal says it is the default.
    settings = load_settings(repo.write_config())
    plane = DataPlane(ModelRepository(settings, make_plugin_manager(), repo.root / "scratch"), settings,
                      repository_control=repository_control_allowed(settings.server, "0.0.0.0:8001"))
    with pytest.raises(PermissionDenied, match=r"^model 'extra': RepositoryModelLoad is turned off on this server "
                                               r"\(server.repository_control is not set, and is off by default when "
                                               r"bind_addr or http_addr is not loopback\)$"):
        asyncio.run(plane.load("extra"))


def test_repository_control_defaults_to_on_for_loopback_only():
    automatic = ServerSettings()
    assert repository_control_allowed(automatic, "127.0.0.1:8001")
    assert repository_control_allowed(automatic, "[::1]:8001")
    assert repository_control_allowed(automatic, "localhost:8001")
    assert not repository_control_allowed(automatic, "0.0.0.0:8001")
    assert not repository_control_allowed(automatic, "[::]:8001")
    assert not repository_control_allowed(automatic, "10.1.2.3:8001")
    assert repository_control_allowed(ServerSettings(repository_control=True), "0.0.0.0:8001")
    assert not repository_control_allowed(ServerSettings(repository_control=False), "127.0.0.1:8001")


def test_requests_over_max_message_bytes_are_resource_exhausted_naming_the_limit(repo, serve):
    assert DEFAULT_MAX_MESSAGE_BYTES == 64 << 20
    repo.python("big", textproto=textproto_single("FP32", "[-1]", max_batch_size=0))
    server = serve(repo.write_config(server_extra="  max_message_bytes: 1048576\n"))
    small = triton.InferInput("input", [1000], "FP32")
    small.set_data_from_numpy(np.ones(1000, np.float32))
    assert server.client.infer("big", [small]).as_numpy("output").shape == (1000,)
    large = triton.InferInput("input", [300_000], "FP32")
    large.set_data_from_numpy(np.ones(300_000, np.float32))
    # (gRPC's own words, which the README quotes: it refuses the message before nereid sees it.)
    expect_grpc_error("RESOURCE_EXHAUSTED", lambda: server.client.infer("big", [large]),
                      "Received message larger than max (", " vs. 1048576)")


# --------------------------------------------------------------------------- symlinks and paths


def test_a_symlinked_model_folder_outside_the_repository_is_refused_unless_allowed(repo, serve, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "model_inference.textproto").write_text(textproto_single())
    (outside / "main.py").write_text("print()\n")
    (repo.models_dir / "linked").symlink_to(outside)
    server = serve(repo.write_config())
    index = {m.name: m for m in server.client.get_model_repository_index().models}
    assert index["linked"].state == "UNAVAILABLE"
    assert "linked is a symlink to" in index["linked"].reason
    assert "server.follow_symlinks: true" in index["linked"].reason

    allowed = serve(repo.write_config(server_extra="  follow_symlinks: true\n"))
    assert allowed.client.is_model_ready("linked")


def test_a_symlinked_file_leading_out_of_the_repository_is_refused(repo, serve, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("input_shape: [4]\noutput_shape: [4]\n")
    folder = repo.add("sneaky", None, main_py="print()\n")
    (folder / "model_inference.textproto").symlink_to(secret)
    server = serve(repo.write_config())
    index = {m.name: m for m in server.client.get_model_repository_index().models}
    assert index["sneaky"].state == "UNAVAILABLE"
    assert "sneaky/model_inference.textproto is a symlink to" in index["sneaky"].reason


def test_load_failures_on_the_wire_name_files_relative_to_the_repository(repo, serve):
    repo.add("broken", "input_shape: [4\n", main_py="print()")
    server = serve(repo.write_config("- name: broken\n"))
    absolute = str(repo.models_dir.resolve())
    index = {m.name: m for m in server.client.get_model_repository_index().models}
    assert index["broken"].reason.startswith("broken/model_inference.textproto:"), index["broken"].reason
    assert absolute not in index["broken"].reason
    message = expect_grpc_error("INTERNAL", lambda: server.client.load_model("broken"),
                                "broken/model_inference.textproto")
    assert absolute not in message and str(repo.root) not in message


# --------------------------------------------------------------------------- SIGTERM while loading

SLOW_LOAD_SERVER = '''
import asyncio, logging, subprocess, sys, time
from pathlib import Path

from nereid.backend import BackendClaim
from nereid.hookspecs import hookimpl
from nereid.plugins import make_plugin_manager
from nereid.server import NereidServer
from nereid.settings import load_settings


class SlowLoad:
    """A model whose load starts a program and then takes 60 s."""

    platform = "slow_load"

    def __init__(self, context):
        self.context = context

    def load(self):
        child = subprocess.Popen(["sleep", "300"])
        Path(sys.argv[3]).write_text(str(child.pid))
        time.sleep(60)


@hookimpl
def nereid_claim_model(folder, declared):
    return BackendClaim(SlowLoad) if (folder / "slow.txt").is_file() else None


logging.basicConfig(level=logging.INFO)
manager = make_plugin_manager(extra_plugins=(sys.modules[__name__],))
asyncio.run(NereidServer(load_settings(Path(sys.argv[1])), manager=manager,
                         bind_addr=sys.argv[2]).serve_until_signalled())
'''


def test_sigterm_during_a_slow_load_exits_within_the_grace_and_kills_what_the_load_started(repo, tmp_path):
    """A load that took 66 s delayed exit by 71 s with a 5 s grace; its programs lived on."""
    folder = repo.models_dir / "slow"
    folder.mkdir()
    (folder / "slow.txt").write_text("")
    config = repo.write_config(server_extra="  shutdown_grace_s: 1\n", metrics_addr="")
    script = tmp_path / "slow_load_server.py"
    script.write_text(textwrap.dedent(SLOW_LOAD_SERVER))
    pid_file = tmp_path / "child.pid"
    process = subprocess.Popen([sys.executable, str(script), str(config), f"127.0.0.1:{free_port()}",
                                str(pid_file)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and process.poll() is None, "the load never started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
        took = time.monotonic() - started
        assert took < 5, f"exit took {took:.1f} s with a 1 s grace"
        output = process.stderr.read()
        assert "ended 1 process(es) left by abandoned loads or calls" in output, output
        deadline = time.monotonic() + 5
        while process_alive(child):
            assert time.monotonic() < deadline, "the program the load started is still running"
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


STUCK_MODEL_SERVER = '''
import asyncio, logging, sys, threading
from pathlib import Path

from nereid.backend import BackendClaim
from nereid.hookspecs import hookimpl
from nereid.plugins import make_plugin_manager
from nereid.server import NereidServer
from nereid.signature import ModelSignature, TensorSpec
from nereid.dtypes import DType


class Stuck:
    """An in-process model whose every call blocks forever (native code that never returns)."""

    platform = "stuck"

    def __init__(self, context):
        pass

    def load(self):
        pass

    def signature(self):
        spec = TensorSpec("input", DType.INT8, (4,))
        return ModelSignature((spec,), (TensorSpec("output", DType.INT8, (4,)),), 0)

    def infer(self, inputs):
        Path(sys.argv[3]).write_text("running")
        threading.Event().wait()

    def unload(self):
        pass


@hookimpl
def nereid_claim_model(folder, declared):
    return BackendClaim(Stuck) if (folder / "stuck.txt").is_file() else None


logging.basicConfig(level=logging.INFO)
manager = make_plugin_manager(extra_plugins=(sys.modules[__name__],))
from nereid.settings import load_settings
asyncio.run(NereidServer(load_settings(Path(sys.argv[1])), manager=manager,
                         bind_addr=sys.argv[2]).serve_until_signalled())
'''


def test_sigterm_with_an_in_process_call_that_never_returns_still_exits(repo, tmp_path):
    """Worker threads were joined at exit: a stuck backend call made SIGTERM hang forever."""
    folder = repo.models_dir / "stuck"
    folder.mkdir()
    (folder / "stuck.txt").write_text("")
    config = repo.write_config(server_extra="  shutdown_grace_s: 1\n", metrics_addr="")
    script = tmp_path / "stuck_server.py"
    script.write_text(textwrap.dedent(STUCK_MODEL_SERVER))
    marker = tmp_path / "running"
    port = free_port()
    process = subprocess.Popen([sys.executable, str(script), str(config), f"127.0.0.1:{port}", str(marker)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while True:
            try:
                if client.is_model_ready("stuck"):
                    break
            except InferenceServerException:
                pass
            assert time.monotonic() < deadline and process.poll() is None, "the server never became ready"
            time.sleep(0.1)
        tensor = triton.InferInput("input", [4], "INT8")
        tensor.set_data_from_numpy(np.zeros(4, np.int8))
        with pytest.raises(InferenceServerException):
            client.infer("stuck", [tensor], client_timeout=0.5)  # abandoned: the call runs on, forever
        client.close()
        assert marker.exists()
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert time.monotonic() - started < 9  # grace 1 s + 2 s for termination + unload
        assert "did not end; abandoning them" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_nereid_check_refuses_a_folder_symlinked_outside_the_repository(repo, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "model_inference.textproto").write_text(textproto_single())
    (outside / "main.py").write_text("print()\n")
    (repo.models_dir / "linked").symlink_to(outside)
    config = repo.write_config()
    result = subprocess.run([sys.executable, "-m", "nereid.cli", "check", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "linked: UNAVAILABLE:" in result.stdout and "server.follow_symlinks: true" in result.stdout


def test_relative_tls_paths_in_a_kubernetes_secret_layout_follow_its_updates(tmp_path, pki):
    """Relative paths were resolved through nereid.yaml's symlink into the Secret's versioned folder
    (..v1/tls.crt), which the next update deletes: the certificate was never renewed."""
    from nereid.settings import load_settings

    mount = tmp_path / "mount"
    version = mount / "..v1"
    version.mkdir(parents=True)
    (tmp_path / "ml-backends").mkdir()
    (version / "nereid.yaml").write_text(f'server:\n  ml_backends_path: "{tmp_path / "ml-backends"}"\n'
                                         '  tls:\n    cert: "tls.crt"\n    key: "tls.key"\n')
    shutil.copy(pki["server_cert"], version / "tls.crt")
    shutil.copy(pki["server_key"], version / "tls.key")
    (mount / "..data").symlink_to("..v1")
    for name in ("nereid.yaml", "tls.crt", "tls.key"):
        (mount / name).symlink_to(f"..data/{name}")
    tls = load_settings(mount / "nereid.yaml").server.tls
    assert (tls.cert, tls.key) == (mount / "tls.crt", mount / "tls.key")  # the names the updates keep
    # A nereid.yaml symlinked from elsewhere still finds the files beside the real one.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "nereid.yaml").symlink_to(version / "nereid.yaml")
    assert load_settings(elsewhere / "nereid.yaml").server.tls.cert == version / "tls.crt"


def test_failed_tls_handshakes_write_no_lines_of_grpc_core(repo, pki):
    """Defect: each failed handshake on the gRPC port (a plaintext probe, a client without a certificate) wrote a
    line of gRPC's core to stderr ("I1201 ... ssl_transport_security.cc ... Handshake failed"), in its own format,
    past --log-level and without any limit."""
    import grpc

    repo.python("echo")
    config = repo.write_config(server_extra=tls_yaml(pki, client_ca=True))
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "GRPC_VERBOSITY"}
    process = subprocess.Popen([*NEREID, "serve", "--config", str(config), "--bind", f"127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert wait_until(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 30)
        for _ in range(5):  # plaintext gRPC calls on the TLS port: each handshake fails
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.RpcError):
                    channel.unary_unary("/inference.GRPCInferenceService/ServerLive")(b"", timeout=2)
        # (The storage hunt: a TLS client naming a server the certificate does not, without a client certificate,
        # wrote an ERROR line of gRPC's core per connection, the name its own text.)
        for _ in range(3):
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                with context.wrap_socket(raw, server_hostname="a-name-the-certificate-lacks.example") as tls:
                    tls.recv(1)
        process.send_signal(signal.SIGTERM)
        stderr = process.communicate(timeout=30)[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "Handshake failed" not in stderr and "ssl_transport_security" not in stderr, stderr
    assert "No match found for server name" not in stderr, stderr


@pytest.mark.parametrize("case, said", [
    ("rogue", "the store's TLS certificate is not trusted (UnknownIssuer); set SSL_CERT_FILE"),
    ("expired", "the store's TLS certificate is out of its validity period (ExpiredContext)"),
])
def test_a_store_whose_certificate_is_refused_is_said_why(pki, monkeypatch, case, said) -> None:
    """The README walkthrough of the certificate hint: obstore's real dump is pretty-printed ("InvalidCertificate(\\n
    UnknownIssuer,"), and the one-line pattern never matched: the reason stayed "cannot reach the store". The hunt
    of the fix: an expired certificate is rustls' ExpiredContext, and was given the CA advice."""
    import threading

    import obstore

    from nereid.storage import StoreURL, describe_error, open_store

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if case == "rogue":
        context.load_cert_chain(pki["rogue_cert"], pki["rogue_key"])  # (its CA is no one's)
    else:  # signed by the trusted CA, expired yesterday
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(_name("old")).issuer_name(pki["ca_cert"].subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=30)).not_valid_after(now - datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(pki["ca_key"].public_key()),
                               critical=False)
                .sign(pki["ca_key"], hashes.SHA256()))
        (pki["folder"] / "old.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (pki["folder"] / "old.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                                  serialization.PrivateFormat.PKCS8,
                                                                  serialization.NoEncryption()))
        context.load_cert_chain(pki["folder"] / "old.crt", pki["folder"] / "old.key")
        monkeypatch.setenv("SSL_CERT_FILE", str(pki["ca"]))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = listener.accept()
                with contextlib.suppress(OSError, ssl.SSLError), context.wrap_socket(connection, server_side=True):
                    pass
    threading.Thread(target=serve, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"https://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    try:
        store = open_store(StoreURL("s3", "models", ""), max_retries=0)
        with pytest.raises(Exception) as refused:
            list(obstore.list(store))
    finally:
        listener.close()
    assert describe_error(refused.value, "s3").startswith(said), describe_error(refused.value, "s3")
