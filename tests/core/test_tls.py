"""nereid.tls against real listeners: the HTTP listener (uvicorn) and a gRPC server on server_credentials,
with certificates made here with ``cryptography``: which keys and validity dates are checked out, that both
listeners let in the same clients, and that a client of a removed client CA gets nothing by resuming a TLS
session."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import logging
import math
import os
import pty
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nereid.protocol.http_listener import HttpListener
from nereid.tls import TlsFileError, TlsSettings, read_tls_material, server_credentials, ssl_context

# --------------------------------------------------------------------------- certificates

NOW = datetime.datetime.now(datetime.timezone.utc)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


class Issuer:
    """A CA (root or intermediate) that signs certificates into ``folder``."""

    def __init__(self, folder: Path, name: str, parent: "Issuer | None" = None) -> None:
        self.folder, self.name = folder, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        signer = parent or self
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(signer.name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(NOW - datetime.timedelta(minutes=5))
                     .not_valid_after(NOW + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False),
                                    critical=True)
                     .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
                     .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.key.public_key()),
                                    critical=False)
                     .sign(signer.key, hashes.SHA256()))
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)
        self.path = folder / f"{name}.pem"
        self.path.write_bytes(self.pem)
        self.chain = b"" if parent is None else self.pem + parent.chain  # what a leaf sends above itself

    def leaf(self, name: str, key=None, with_chain: bool = False, valid_from: datetime.datetime | None = None,
             valid_to: datetime.datetime | None = None) -> tuple[Path, Path]:
        """A certificate for localhost / 127.0.0.1 (server or client) signed here: (cert path, key path).

        ``with_chain`` appends the intermediates (this issuer and its parents below the root). Valid from
        5 minutes ago for a year unless ``valid_from`` / ``valid_to`` say otherwise (a certificate that
        expires within 30 days is warned about)."""
        key = key or ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(self.name))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(valid_from or NOW - datetime.timedelta(minutes=5))
                .not_valid_after(valid_to or NOW + datetime.timedelta(days=365))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        cert_path, key_path = self.folder / f"{name}.crt", self.folder / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + (self.chain if with_chain else b""))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return cert_path, key_path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "pki"
    path.mkdir()
    return path


def replace(path: Path, source: Path) -> None:
    """Swap ``path``'s contents for ``source``'s in one rename, as certificate tooling does."""
    staged = path.with_name(path.name + ".new")
    staged.write_bytes(source.read_bytes())
    os.replace(staged, path)


# --------------------------------------------------------------------------- listeners and clients


async def ok_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.contextmanager
def https_listener(tls: TlsSettings, app=ok_app, grace_s: float = 5) -> Iterator[int]:
    """nereid's HTTP listener on ``ssl_context(tls)``, on a loop of its own; yields its port."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    listener = HttpListener(app, ssl_context(tls), grace_s=grace_s)
    try:
        yield asyncio.run_coroutine_threadsafe(listener.start("127.0.0.1:0"), loop).result(10)
    finally:
        asyncio.run_coroutine_threadsafe(listener.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def grpc_listener(tls: TlsSettings) -> Iterator[int]:
    """A gRPC server (the health service) on ``server_credentials(tls)``; yields its port."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(tls))
    server.start()
    try:
        yield port
    finally:
        server.stop(None).wait()


def grpc_ok(port: int, ca: Path, client: tuple[Path, Path] | None = None) -> bool:
    """Whether a health check over a new TLS channel, trusting ``ca``, is answered."""
    key, chain = (client[1].read_bytes(), client[0].read_bytes()) if client else (None, None)
    credentials = grpc.ssl_channel_credentials(ca.read_bytes(), key, chain)
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return True
        except grpc.RpcError:
            return False


def client_context(ca: Path, client: tuple[Path, Path] | None = None,
                   version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(*client)
    if version is not None:
        context.minimum_version = context.maximum_version = version
    return context


def https_get(port: int, context: ssl.SSLContext,
              session: ssl.SSLSession | None = None) -> tuple[bool, ssl.SSLSession | None, bool]:
    """GET over a new connection (offering ``session``): (answered 200, the session, whether it was resumed).

    The answer is read to its end, so a TLS 1.3 client has its tickets (they come after the handshake)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="localhost", session=session) as conn:
                conn.sendall(b"GET / HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
                answer = b""
                while chunk := conn.recv(4096):
                    answer += chunk
                return answer.startswith(b"HTTP/1.1 200 "), conn.session, conn.session_reused
        except (ssl.SSLError, OSError):
            return False, None, False


def https_ok(port: int, ca: Path, client: tuple[Path, Path] | None = None) -> bool:
    return https_get(port, client_context(ca, client))[0]


# --------------------------------------------------------------------------- mutual TLS: who is let in


def test_a_client_ca_of_only_an_intermediate_lets_its_clients_in_on_both_listeners(folder):
    """HTTPS refused, silently, the clients gRPC let in when client_ca held only the issuing intermediate."""
    root = Issuer(folder, "root")
    intermediate = Issuer(folder, "intermediate", parent=root)
    server_cert, server_key = root.leaf("server")
    client = intermediate.leaf("client", with_chain=True)  # leaf + intermediate, as clients send them
    rogue = Issuer(folder, "other-root").leaf("rogue", with_chain=True)
    for client_ca in (intermediate.path, root.path):
        tls = TlsSettings(server_cert, server_key, client_ca)
        with https_listener(tls) as https, grpc_listener(tls) as grpc_port:
            assert https_ok(https, root.path, client), client_ca.name
            assert grpc_ok(grpc_port, root.path, client), client_ca.name
            assert not https_ok(https, root.path, rogue)
            assert not grpc_ok(grpc_port, root.path, rogue)
            assert not https_ok(https, root.path)  # no certificate at all


def test_files_saved_with_a_byte_order_mark_serve_both_listeners(folder) -> None:
    """The config hunt: a client_ca saved with a UTF-8 byte order mark (as a Windows editor may) passed the check,
    which Python's OpenSSL reads, and serve failed at gRPC's port, blaming server.bind_addr; a cert or key so saved
    was refused as a kind of key gRPC cannot serve. The mark is skipped, as OpenSSL skips it."""
    root = Issuer(folder, "root")
    cert, key = root.leaf("server")
    client = root.leaf("client")
    marked = []
    for path in (cert, key, root.path):
        copy = folder / f"bom-{path.name}"
        copy.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
        marked.append(copy)
    tls = TlsSettings(*marked)
    read_tls_material(tls)
    with https_listener(tls) as https, grpc_listener(tls) as grpc_port:
        assert https_ok(https, root.path, client) and grpc_ok(grpc_port, root.path, client)
        assert not https_ok(https, root.path) and not grpc_ok(grpc_port, root.path)  # (mutual TLS, still)


def test_https_checks_client_certificates_as_grpc_does_whatever_python_s_defaults(folder) -> None:
    """The 3.12/3.13 hunt: Python 3.13's default context adds VERIFY_X509_STRICT, which refused over HTTPS a client
    certificate without an Authority Key Identifier that gRPC let in (and 3.11 and 3.12 did). The flags a server
    context verifies with are the same on every Python."""
    import ssl

    from nereid.tls import _http_context

    root = Issuer(folder, "root")
    cert, key = root.leaf("server")
    flags = _http_context(TlsSettings(cert, key, root.path)).verify_flags
    assert flags & ssl.VERIFY_X509_PARTIAL_CHAIN and not flags & ssl.VERIFY_X509_STRICT, flags


def test_a_client_refused_at_the_https_handshake_is_logged_with_the_reason(folder, caplog):
    """The security hunt: a client refused under mutual TLS (no certificate, another CA) or speaking plain HTTP to
    the HTTPS port left no trace in the log (asyncio says it in debug mode only), the client seeing only a closed
    connection."""
    root = Issuer(folder, "root")
    server_cert, server_key = root.leaf("server")
    rogue = Issuer(folder, "other-root").leaf("rogue", with_chain=True)
    caplog.set_level(logging.INFO, "nereid.tls")
    with https_listener(TlsSettings(server_cert, server_key, root.path)) as https:
        assert not https_ok(https, root.path)  # no client certificate
        assert not https_ok(https, root.path, rogue)  # one from another CA
        with socket.create_connection(("127.0.0.1", https), timeout=10) as plain:
            plain.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            plain.recv(1024)  # (closed)
        with socket.create_connection(("127.0.0.1", https), timeout=10):
            pass  # a TCP probe: connects and leaves, nothing to say
    # (Each logged before its connection was closed, so before its client saw it fail.)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HTTPS: a client's TLS handshake")]
    assert len(lines) == 3, lines
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in lines[0] or "peer did not return a certificate" in lines[0], lines
    assert "CERTIFICATE_VERIFY_FAILED" in lines[1] or "certificate verify failed" in lines[1], lines
    assert lines[2] == "HTTPS: a client's TLS handshake failed: it spoke plain HTTP to the HTTPS listener", lines
    assert not any("_ssl.c" in line for line in lines), lines


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2], ids=["TLS1.3", "TLS1.2"])
def test_a_client_of_a_removed_client_ca_cannot_get_back_in_by_resuming_its_session(folder, version):
    """Session tickets (TLS 1.3 and 1.2) and TLS 1.2's session-ID cache belonged to the context the listener
    started with, which outlived every change: a client kept access for ever after its CA left client_ca."""
    ca, other = Issuer(folder, "ca"), Issuer(folder, "other-ca")
    server_cert, server_key = ca.leaf("server")
    client_ca = folder / "client-ca.pem"
    client_ca.write_bytes(ca.pem)
    client = client_context(ca.path, ca.leaf("client"), version)
    with https_listener(TlsSettings(server_cert, server_key, client_ca)) as port:
        answered, session, _ = https_get(port, client)
        assert answered and session is not None
        answered, session, resumed = https_get(port, client, session)
        assert answered and resumed  # while the files stay as they are, sessions are resumed
        replace(client_ca, other.path)  # the client's CA is no longer trusted
        assert https_get(port, client, session)[0] is False  # its session resumes nothing...
        assert https_get(port, client)[0] is False  # ...and a full handshake is refused
        assert https_get(port, client_context(ca.path, other.leaf("new-client"), version))[0]
        replace(client_ca, ca.path)  # trusted again: a new context, and a session of the old one is not resumed
        answered, _, resumed = https_get(port, client, session)
        assert answered and not resumed


# --------------------------------------------------------------------------- which files are checked out


def encrypted(key_path: Path, legacy: bool = False) -> Path:
    """The key at ``key_path`` encrypted with a passphrase: PKCS#8, or the older 'Proc-Type: 4,ENCRYPTED' PEM."""
    key = serialization.load_pem_private_key(key_path.read_bytes(), None)
    form = serialization.PrivateFormat.TraditionalOpenSSL if legacy else serialization.PrivateFormat.PKCS8
    path = key_path.with_name(key_path.stem + ("-legacy" if legacy else "") + "-encrypted.key")
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, form,
                                       serialization.BestAvailableEncryption(b"secret")))
    return path


@pytest.mark.parametrize("legacy", [False, True], ids=["pkcs8", "proc-type"])
def test_an_encrypted_key_is_refused_by_name_without_asking_for_a_passphrase(folder, legacy):
    """OpenSSL asked on the terminal (nereid check and serve waited at 'Enter PEM pass phrase:'), or said
    '[Errno 22] Invalid argument' without one."""
    cert, key = Issuer(folder, "ca").leaf("server", rsa.generate_private_key(65537, 2048) if legacy else None)
    with pytest.raises(TlsFileError) as info:
        read_tls_material(TlsSettings(cert, encrypted(key, legacy)))
    assert info.value.key == "key"
    assert "is an encrypted (passphrase-protected) private key, which nereid does not support" in str(info.value)
    assert "openssl pkey -in" in str(info.value)


def test_nereid_check_under_a_terminal_refuses_an_encrypted_key_at_once(repo, folder):
    cert, key = Issuer(folder, "ca").leaf("server")
    config = repo.write_config(server_extra=f'  tls:\n    cert: "{cert}"\n    key: "{encrypted(key)}"\n')
    controller, terminal = pty.openpty()
    # A session of its own whose controlling terminal is the pty, as an operator's shell: OpenSSL's
    # passphrase prompt reads /dev/tty, and would wait there.
    take_terminal = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                     "os.execv(sys.executable, [sys.executable, '-m', 'nereid.cli'] + sys.argv[1:])")
    process = subprocess.Popen([sys.executable, "-c", take_terminal, "check", "--config", str(config)],
                               stdin=terminal, stdout=terminal, stderr=terminal, start_new_session=True)
    os.close(terminal)
    output = b""
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(controller, 4096)
                except OSError:  # the terminal's last writer is gone
                    break
                if not chunk:
                    break
                output += chunk
        assert process.wait(5) == 2, output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(controller)
    assert b"pass phrase" not in output
    assert b"server.tls.key:" in output and b"encrypted (passphrase-protected) private key" in output, output


def test_a_rotated_in_encrypted_key_is_logged_and_skipped_by_both_listeners(folder, caplog):
    ca = Issuer(folder, "ca")
    cert, key = ca.leaf("server")
    tls = TlsSettings(cert, key)
    with https_listener(tls) as https, grpc_listener(tls) as grpc_port:
        assert https_ok(https, ca.path) and grpc_ok(grpc_port, ca.path)
        replace(key, encrypted(key))
        assert https_ok(https, ca.path) and grpc_ok(grpc_port, ca.path)  # the previous key stays in use
    for listener in ("HTTP", "gRPC"):
        assert (f"server.tls.key changed but cannot be used by the {listener} listener (keeping the previous "
                f"certificate): {key} is an encrypted (passphrase-protected) private key") in caplog.text


SERVED_KEYS = {"RSA 2048": lambda: rsa.generate_private_key(65537, 2048),
               "EC P-256": lambda: ec.generate_private_key(ec.SECP256R1()),
               "EC P-384": lambda: ec.generate_private_key(ec.SECP384R1()),
               "EC P-521": lambda: ec.generate_private_key(ec.SECP521R1()),
               "Ed25519": ed25519.Ed25519PrivateKey.generate}
# Keys Python's OpenSSL serves and gRPC's BoringSSL does not.
UNSERVED_KEYS = {"DSA 2048": lambda: dsa.generate_private_key(2048),
                 "EC secp256k1": lambda: ec.generate_private_key(ec.SECP256K1()),
                 "EC P-224": lambda: ec.generate_private_key(ec.SECP224R1()),
                 "EC brainpoolP256r1": lambda: ec.generate_private_key(ec.BrainpoolP256R1()),
                 "Ed448": ed448.Ed448PrivateKey.generate}


def grpc_adds_port(cert: Path, key: Path) -> bool:
    """Whether gRPC itself takes the files (a server of its own, without nereid's check)."""
    server = grpc.server(futures.ThreadPoolExecutor(1))
    try:
        return server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
            [(key.read_bytes(), cert.read_bytes())])) != 0
    except RuntimeError:
        return False
    finally:
        server.start()
        server.stop(None).wait()


def test_the_check_takes_the_keys_grpc_serves_and_refuses_by_name_those_it_does_not(folder):
    """A DSA or secp256k1 key passed nereid check, and nereid serve then failed blaming server.bind_addr."""
    ca = Issuer(folder, "ca")
    for kind, make in SERVED_KEYS.items():
        cert, key = ca.leaf(kind.replace(" ", "-"), make())
        read_tls_material(TlsSettings(cert, key))
        with grpc_listener(TlsSettings(cert, key)) as port, https_listener(TlsSettings(cert, key)) as https:
            with client_context(ca.path).wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5),
                                                     server_hostname="localhost"):
                pass  # the gRPC listener's handshake, by an OpenSSL client
            # grpcio's own client (BoringSSL) offers neither Ed25519 nor P-521 signatures: it cannot reach
            # such a server (an OpenSSL client can).
            assert kind in ("Ed25519", "EC P-521") or grpc_ok(port, ca.path), kind
            assert https_ok(https, ca.path), kind
    for kind, make in UNSERVED_KEYS.items():
        cert, key = ca.leaf(kind.replace(" ", "-"), make())
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)  # Python's ssl takes it
        assert not grpc_adds_port(cert, key), kind
        with pytest.raises(TlsFileError) as info:
            read_tls_material(TlsSettings(cert, key))
        assert info.value.key == "key", kind
        assert str(info.value).startswith(f"gRPC (BoringSSL) cannot serve {cert} with {key}: it takes RSA keys, "
                                          f"EC keys on the P-256, P-384 or P-521 curves, and Ed25519 keys"), kind


# --------------------------------------------------------------------------- validity dates

DAY = datetime.timedelta(days=1)


def when(moment: datetime.datetime) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC"


@pytest.mark.parametrize("dates", ["expired", "not yet valid"])
def test_a_server_certificate_outside_its_validity_period_is_refused_by_name_with_its_dates(repo, folder, dates):
    """An expired (or not yet valid) certificate passed nereid check and was served: every client refused it."""
    start, end = (NOW - 10 * DAY, NOW - DAY) if dates == "expired" else (NOW + DAY, NOW + 10 * DAY)
    cert, key = Issuer(folder, "ca").leaf("server", valid_from=start, valid_to=end)
    with pytest.raises(TlsFileError) as info:
        read_tls_material(TlsSettings(cert, key))
    assert info.value.key == "cert"
    problem = f"{cert} expired at {when(end)}" if dates == "expired" else f"{cert} is not valid until {when(start)}"
    assert str(info.value).startswith(f"{problem} (valid from {when(start)} to {when(end)}, now "), str(info.value)
    if dates == "expired":  # nereid check and serve report any unusable TLS file alike: one case runs check
        config = repo.write_config(server_extra=f'  tls:\n    cert: "{cert}"\n    key: "{key}"\n')
        result = subprocess.run([sys.executable, "-m", "nereid.cli", "check", "--config", str(config)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert f"server.tls.cert: {problem} (valid from {when(start)} to {when(end)}" in result.stderr


@pytest.mark.parametrize("unusable", ["grpc_cannot_serve", "expired"])
def test_files_that_cannot_be_served_rotated_in_are_logged_and_skipped_by_both_listeners(folder, caplog,
                                                                                        unusable: str):
    """gRPC kept its certificate while nereid logged 'new gRPC connections use them'; an expired one was announced
    so too, and every new connection failed."""
    ca = Issuer(folder, "ca")
    cert, key = ca.leaf("server")
    if unusable == "grpc_cannot_serve":
        new_cert, new_key = ca.leaf("secp256k1", ec.generate_private_key(ec.SECP256K1()))
        why = f"gRPC (BoringSSL) cannot serve {cert} with {key}"
    else:
        new_cert, new_key = ca.leaf("expired", valid_from=NOW - 10 * DAY, valid_to=NOW - DAY)
        why = (f"{cert} expired at {when(NOW - DAY)} (valid from {when(NOW - 10 * DAY)} to "
               f"{when(NOW - DAY)}, now ")
    tls = TlsSettings(cert, key)
    with https_listener(tls) as https, grpc_listener(tls) as grpc_port:
        replace(key, new_key)
        replace(cert, new_cert)
        assert https_ok(https, ca.path) and grpc_ok(grpc_port, ca.path)  # the previous certificate
    assert "connections use them" not in caplog.text
    for listener in ("HTTP", "gRPC"):  # (named by the files seen changed: both, or each in turn)
        assert (f" changed but cannot be used by the {listener} listener (keeping the previous "
                f"certificate): {why}") in caplog.text


def test_a_rotation_error_names_the_file_that_changed(folder, caplog):
    """Found by a bug hunt: a new certificate that does not match the unchanged key was logged as
    "server.tls.key changed": an operator looked at the wrong file."""
    ca = Issuer(folder, "ca")
    cert, key = ca.leaf("server")
    other_cert, _ = ca.leaf("other")
    tls = TlsSettings(cert, key)
    with https_listener(tls) as https, grpc_listener(tls) as grpc_port:
        replace(cert, other_cert)
        assert https_ok(https, ca.path) and grpc_ok(grpc_port, ca.path)  # the previous certificate
    for listener in ("HTTP", "gRPC"):
        assert f"server.tls.cert changed but cannot be used by the {listener} listener" in caplog.text
    assert "server.tls.key changed" not in caplog.text


def test_a_client_ca_holding_no_certificate_is_refused_by_name(folder):
    """Found by a bug hunt: a client_ca of CRLs alone passed nereid check; the server then failed to bind
    ("cannot listen on ... (server.bind_addr)"), and swapped in, it made HTTPS refuse every client."""
    from nereid.tls import TlsFileError, read_tls_material

    ca = Issuer(folder, "ca")
    cert, key = ca.leaf("server")
    crl = (x509.CertificateRevocationListBuilder().issuer_name(_name("ca")).last_update(NOW)
           .next_update(NOW + DAY).sign(ca.key, hashes.SHA256()))
    crl_only = folder / "crl.pem"
    crl_only.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(TlsFileError, match="holds no PEM certificate to verify clients with") as refused:
        read_tls_material(TlsSettings(cert, key, crl_only))
    assert refused.value.key == "client_ca"


def test_a_certificate_rotated_in_before_it_is_valid_is_served_once_it_is(folder, caplog):
    """Skipped as unusable, it would never be read again: nothing changes on disk when it becomes valid."""
    caplog.set_level(logging.INFO, "nereid.tls")
    old_ca, new_ca = Issuer(folder, "old-ca"), Issuer(folder, "new-ca")
    cert, key = old_ca.leaf("server")
    # Certificates count whole seconds: from the next whole second at least 1.2 s away.
    start = datetime.datetime.fromtimestamp(math.ceil(time.time() + 1.2), datetime.timezone.utc)
    early_cert, early_key = new_ca.leaf("early", valid_from=start, valid_to=start + 365 * DAY)
    tls = TlsSettings(cert, key)
    with https_listener(tls) as https, grpc_listener(tls) as grpc_port:
        replace(key, early_key)
        replace(cert, early_cert)
        assert https_ok(https, old_ca.path) and grpc_ok(grpc_port, old_ca.path)  # the previous certificate
        assert time.time() < start.timestamp(), "too slow to see the certificate before it is valid"
        for listener in ("HTTP", "gRPC"):
            assert (f" changed but cannot be used by the {listener} listener yet (keeping the "
                    f"previous certificate; it is read again at {when(start)} unless the files change before): "
                    f"{cert} is not valid until {when(start)}") in caplog.text
        time.sleep(start.timestamp() - time.time() + 0.05)
        assert https_ok(https, new_ca.path) and grpc_ok(grpc_port, new_ca.path)  # served now that it is valid
        assert not https_ok(https, old_ca.path) and not grpc_ok(grpc_port, old_ca.path)
    for listener in ("HTTP", "gRPC"):
        assert f"new {listener} connections use them" in caplog.text


def expiry_warnings(caplog, cert: Path) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.levelno == logging.WARNING and record.getMessage().startswith(f"server.tls.cert: {cert} ")]


def test_a_certificate_that_expires_within_30_days_is_warned_about_once_at_start_and_on_rotation(folder, caplog):
    caplog.set_level(logging.INFO, "nereid.tls")
    ca = Issuer(folder, "ca")
    cert, key = ca.leaf("server", valid_to=NOW + 10 * DAY)
    tls = TlsSettings(cert, key)
    read_tls_material(tls)  # nereid.yaml is read: the warning...
    [warning] = expiry_warnings(caplog, cert)
    assert warning.startswith(f"server.tls.cert: {cert} expires at {when(NOW + 10 * DAY)}, in 9 days (valid from "
                              f"{when(NOW - datetime.timedelta(minutes=5))} to {when(NOW + 10 * DAY)}, now "), warning
    assert warning.endswith("): clients refuse it from then on; renew it"), warning
    with https_listener(tls) as https, grpc_listener(tls) as grpc_port:  # ...not again for each listener
        assert len(expiry_warnings(caplog, cert)) == 1
        renewed_cert, renewed_key = ca.leaf("renewed", valid_to=NOW + 20 * DAY)
        replace(key, renewed_key)
        replace(cert, renewed_cert)
        assert https_ok(https, ca.path) and grpc_ok(grpc_port, ca.path)  # a warning, not a refusal
        assert len(expiry_warnings(caplog, cert)) == 2  # once for the change, not once per listener
        assert f"expires at {when(NOW + 20 * DAY)}, in 19 days" in expiry_warnings(caplog, cert)[1]
        replace(key, ca.leaf("long", valid_to=NOW + 31 * DAY)[1])
        replace(cert, folder / "long.crt")
        assert https_ok(https, ca.path) and grpc_ok(grpc_port, ca.path)
    assert len(expiry_warnings(caplog, cert)) == 2  # more than 30 days left: no warning


def test_a_client_ca_is_warned_about_only_when_none_of_its_certificates_is_valid(folder, caplog):
    """A bundle may keep expired certificates next to valid ones: it is refused for none of them."""
    cert, key = Issuer(folder, "ca").leaf("server")
    expired = Issuer(folder, "expired-ca")
    expired_pem = (x509.CertificateBuilder().subject_name(_name("expired-ca")).issuer_name(_name("expired-ca"))
                   .public_key(expired.key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(NOW - 10 * DAY).not_valid_after(NOW - DAY)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(expired.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    bundle, stale = folder / "bundle.pem", folder / "stale.pem"
    bundle.write_bytes(expired_pem + Issuer(folder, "valid-ca").pem)
    stale.write_bytes(expired_pem)
    read_tls_material(TlsSettings(cert, key, bundle))
    assert "server.tls.client_ca" not in caplog.text
    read_tls_material(TlsSettings(cert, key, stale))  # taken, with a warning
    assert (f"server.tls.client_ca: no certificate in {stale} is valid now (") in caplog.text
    assert (f"valid from {when(NOW - 10 * DAY)} to {when(NOW - DAY)}): every client certificate is refused"
            in caplog.text)


# --------------------------------------------------------------------------- clients that stall and leave


async def big_app(scope, receive, send) -> None:
    body = bytes(16 << 20)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def test_https_clients_that_stall_on_a_large_answer_and_leave_leave_nothing_behind(folder):
    """Over TLS, a client that stopped reading a large answer and then went away left its connection, with every
    unsent byte of the answer in asyncio's TLS buffers, referenced by uvicorn's keep-alive timer, which uvicorn
    cancels only for a connection closed cleanly: for 120 s, 8 such clients a round kept about 490 MiB each."""
    import gc
    from asyncio import sslproto

    def alive() -> int:
        return sum(isinstance(o, sslproto.SSLProtocol) for o in gc.get_objects())

    root = Issuer(folder, "root")
    cert, key = root.leaf("localhost")
    context = client_context(root.path)
    with https_listener(TlsSettings(cert, key), app=big_app) as port:
        before = alive()
        for _ in range(4):
            raw = socket.create_connection(("127.0.0.1", port), timeout=5)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn = context.wrap_socket(raw, server_hostname="localhost")
            conn.sendall(b"GET / HTTP/1.1\r\nhost: localhost\r\n\r\n")
            conn.recv(1024)  # the answer has begun: the rest waits in the server's buffers
            conn.close()  # and the client goes away without reading it
        deadline = time.monotonic() + 10
        while alive() > before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive() <= before, "the stalled clients' TLS connections were never freed"


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2], ids=["TLS1.3", "TLS1.2"])
def test_an_https_client_that_pipelined_a_request_and_left_is_seen_gone(folder, version, monkeypatch):
    """The listener looks for the close of a client whose connection it stopped reading (a request pipelined
    behind the one being answered). Over TLS its first close() waited for a flush that never started (the
    EOF had been read below the paused reading): the connection stayed open until the server stopped, and its
    requests were never told their client had gone."""
    from nereid.protocol.http_listener import _BoundedHeadProtocol

    root = Issuer(folder, "root")
    cert, key = root.leaf("server")
    lost: list[float] = []
    connection_lost = _BoundedHeadProtocol.connection_lost
    monkeypatch.setattr(_BoundedHeadProtocol, "connection_lost",
                        lambda self, exc: (lost.append(time.monotonic()), connection_lost(self, exc))[1])
    started = threading.Event()

    async def slow_app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):  # (the whole body)
            pass
        if scope["path"] == "/slow":
            started.set()
            await asyncio.sleep(3)  # answering, not reading: its client leaves meanwhile
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    request = b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n"
    context = client_context(root.path)
    context.maximum_version = version
    with https_listener(TlsSettings(cert, key), app=slow_app) as port:
        with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5),
                                 server_hostname="localhost") as tls:
            tls.sendall(request % b"/slow")
            assert started.wait(5)
            tls.sendall(request % b"/queued")  # read once the first is being answered: the reading stops
            time.sleep(0.2)
        left = time.monotonic()
        time.sleep(1.5)  # the answer still being made: only the listener's look can see the client gone
        assert lost and lost[0] - left < 1.5, (lost, left)


@pytest.mark.parametrize("kind", ["RSA", "DSA"])
def test_a_client_ca_too_weak_for_the_http_listener_is_refused_by_name(folder, kind):
    """Found by a bug hunt: with an RSA-1024 client CA, gRPC let its clients in while HTTPS (OpenSSL at its
    default security level) refused them all, with nothing logged. A DSA one is told apart by its class's name:
    cryptography 51 deprecates its dsa module, whose use in the check warned at every read of any files."""
    import warnings

    from nereid.tls import TlsFileError, read_tls_material

    cert, key = Issuer(folder, "ca").leaf("server")
    weak_key = rsa.generate_private_key(65537, 1024) if kind == "RSA" else dsa.generate_private_key(1024)
    weak = (x509.CertificateBuilder().subject_name(_name("weak-ca")).issuer_name(_name("weak-ca"))
            .public_key(weak_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(NOW - DAY).not_valid_after(NOW + DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(weak_key, hashes.SHA256()))
    weak_ca = folder / "weak-ca.pem"
    weak_ca.write_bytes(weak.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(TlsFileError, match=f"certificate 'CN=weak-ca' has a 1024-bit {kind} key, too weak") as \
            refused, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        read_tls_material(TlsSettings(cert, key, weak_ca))
    assert refused.value.key == "client_ca"
    # (A DSA key itself warns as cryptography 51 reads it, rightly: only the check of any other key must not.)
    ours = [w for w in warned if w.filename.endswith(os.path.join("core", "tls.py"))]
    assert not ours or kind == "DSA", [str(w) for w in ours]


def test_a_server_key_too_weak_for_the_http_listener_is_refused_as_weak_not_as_a_mismatch(folder):
    """Found by a bug hunt: an RSA-1024 server key was refused as "is not the private key of ..., or one of them
    does not parse: EE_KEY_TOO_SMALL", which sent its user looking for a mismatch that was not there."""
    from nereid.tls import TlsFileError, read_tls_material

    cert, key = Issuer(folder, "ca").leaf("server", key=rsa.generate_private_key(65537, 1024))
    with pytest.raises(TlsFileError) as refused:
        read_tls_material(TlsSettings(cert, key))
    assert str(refused.value) == (
        f"{cert}: its 1024-bit RSA key is too weak for the HTTP listener's OpenSSL (at its default security "
        "level), which refuses to serve with it; use a 2048-bit RSA key or more, or an EC key, signed with "
        "SHA-256 or better")
    assert refused.value.key == "key"


def test_a_running_server_s_edit_of_nereid_yaml_reads_no_tls_file(folder):
    """Found by the CLI read hunt: a certificate that expired while the server served it (serving on, as it does)
    made every later edit of nereid.yaml refused, a model listed never loaded; server: keys wait for a restart,
    so an edit's check reads no TLS file (a start still refuses the expired one)."""
    from nereid.errors import ConfigError
    from nereid.settings import settings_from_bytes

    cert, key = Issuer(folder, "ca").leaf("expired", valid_from=NOW - 10 * DAY, valid_to=NOW - DAY)
    config = folder / "nereid.yaml"
    (folder / "ml-backends" / "m").mkdir(parents=True)
    data = f'server:\n  tls:\n    cert: "{cert}"\n    key: "{key}"\nmodels:\n  - name: m\n'.encode()
    with pytest.raises(ConfigError, match="server.tls.cert: .* expired at"):
        settings_from_bytes(data, config)
    assert [m.name for m in settings_from_bytes(data, config, read_tls=False).models] == ["m"]
    from nereid.watch import ConfigLook, _settings_from  # (what the watcher applies an edit with)

    assert [m.name for m in _settings_from(ConfigLook("digest", data), config).models] == ["m"]
