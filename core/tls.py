"""TLS for the gRPC and HTTP listeners: ``server.tls: {cert, key, client_ca}`` in nereid.yaml.

The files are checked when nereid.yaml is read (``nereid serve`` and ``nereid
check`` stop with the key path when one is missing or unusable), with Python's
own ``ssl`` module: the certificate chain must parse, the key must match it and
must not be encrypted, the client CA must parse; and gRPC must take the
certificate and key (its BoringSSL serves fewer key types than OpenSSL). The
server certificate must be valid now (clients refuse one that expired or is not
yet valid), and one that expires within 30 days is logged as a WARNING. Both
listeners re-read the files when they change on disk: they look before each
new TLS handshake, so a renewed certificate is served to new connections
without a restart (connections already open keep the one they started with),
and TLS sessions made before the change are not resumed after it.
"""

from __future__ import annotations

import codecs
import datetime
import hashlib
import logging
import os
import re
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nereid.log_limit import RateLimitedLog

if TYPE_CHECKING:
    import grpc
    from cryptography import x509

log = logging.getLogger(__name__)

# Certificates and keys are a few kilobytes; a CA bundle can be a few hundred.
MAX_PEM_BYTES = 1 << 20
# A server certificate that expires within this many days is logged as a WARNING when it is read.
EXPIRY_WARNING_DAYS = 30


@dataclass(frozen=True)
class TlsSettings:
    """Where the server's certificate chain, its key, and (for mutual TLS) the client CA are."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def files(self) -> dict[str, Path]:
        """Each configured file by its key under ``server.tls``."""
        named = {"cert": self.cert, "key": self.key}
        if self.client_ca is not None:
            named["client_ca"] = self.client_ca
        return named


class TlsFileError(ValueError):
    """A TLS file that cannot be used; ``key`` is its key under ``server.tls``."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(problem)
        self.key = key


class TlsNotYetValid(TlsFileError):
    """The server certificate is not valid yet: it is from ``valid_from`` (UTC) on."""

    def __init__(self, key: str, problem: str, valid_from: datetime.datetime) -> None:
        super().__init__(key, problem)
        self.valid_from = valid_from


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of a checked :class:`TlsSettings`."""

    cert: bytes
    key: bytes
    client_ca: bytes | None


def read_tls_material(tls: TlsSettings) -> TlsMaterial:
    """Read and check the files; TlsFileError names the key of the first bad one.

    A server certificate that expired is a TlsFileError, one not valid yet a :class:`TlsNotYetValid`; one
    that expires within EXPIRY_WARNING_DAYS is logged as a WARNING (once per process for the same file).
    """
    contents: dict[str, bytes] = {}
    for name, path in tls.files().items():
        try:
            if not path.is_file():
                raise TlsFileError(name, f"no such file {path}" if not path.exists() else f"{path} is not a file")
            if path.stat().st_size > MAX_PEM_BYTES:
                raise TlsFileError(name, f"{path} is larger than {MAX_PEM_BYTES} bytes")
            # Without the UTF-8 byte order mark a Windows editor may put first, which OpenSSL skips and gRPC's
            # BoringSSL does not: a client_ca saved so failed serve at gRPC's port, blaming server.bind_addr, and a
            # cert or key was said to be of a kind gRPC cannot serve (the config hunt).
            contents[name] = path.read_bytes().removeprefix(codecs.BOM_UTF8)
        except OSError as err:
            raise TlsFileError(name, f"cannot read {path}: {err.strerror or err}") from None
    if b"-----BEGIN CERTIFICATE-----" not in contents["cert"]:
        raise TlsFileError("cert", f"{tls.cert} holds no PEM certificate")
    if b"PRIVATE KEY-----" not in contents["key"]:
        raise TlsFileError("key", f"{tls.key} holds no PEM private key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_cert_chain(context, tls)
    if tls.client_ca is not None:
        try:
            context.load_verify_locations(cafile=str(tls.client_ca))
        except (ssl.SSLError, OSError) as err:
            raise TlsFileError("client_ca", f"{tls.client_ca} is not a PEM CA certificate: "
                                            f"{getattr(err, 'reason', None) or err}") from None
        if not context.get_ca_certs():  # (OpenSSL takes a file of CRLs alone, then refuses every client)
            raise TlsFileError("client_ca", f"{tls.client_ca} holds no PEM certificate to verify clients with")
        weak = _weak_authority(contents["client_ca"])
        if weak:
            raise TlsFileError("client_ca", f"{tls.client_ca}: {weak}, too weak for the HTTP listener's OpenSSL (at "
                                            "its default security level), which would refuse every client it signed "
                                            "while gRPC let them in; use a 2048-bit RSA key or more, or an EC key")
    warnings = _check_dates(tls, contents)
    if not _grpc_serves(contents["cert"], contents["key"]):
        raise TlsFileError("key", f"gRPC (BoringSSL) cannot serve {tls.cert} with {tls.key}: it takes RSA keys, EC "
                                  f"keys on the P-256, P-384 or P-521 curves, and Ed25519 keys (not DSA, RSA-PSS, "
                                  f"Ed448, or EC keys on other curves such as secp256k1)")
    for name, warning in warnings:
        _warn_once(name, contents[name], warning)
    return TlsMaterial(contents["cert"], contents["key"], contents.get("client_ca"))


def _weak_authority(pem: bytes) -> str:
    """The first certificate of ``pem`` whose RSA or DSA key is under 2048 bits, said as ``certificate 'CN' has a
    1024-bit RSA key``; "" when none (or when the bundle cannot be read here: OpenSSL took it)."""
    from cryptography import x509

    try:
        authorities = x509.load_pem_x509_certificates(pem)
    except ValueError:
        return ""
    for authority in authorities:
        weak = _weak_key(authority)
        if weak:
            return f"certificate '{authority.subject.rfc4514_string()[:128]}' has a {weak} key"
    return ""


def _weak_key(certificate: "x509.Certificate") -> str:
    """``1024-bit RSA`` when ``certificate``'s key is RSA or DSA under 2048 bits, else ""."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = certificate.public_key()
    if isinstance(key, rsa.RSAPublicKey):
        kind = "RSA"
    elif any(cls.__name__ == "DSAPublicKey" for cls in type(key).__mro__):
        # (Told by name: cryptography 51 deprecates its dsa module, whose every use warned, logged as a WARNING of
        # the server's own code at each read of the files, and a release without it would fail the import.)
        kind = "DSA"
    else:
        return ""
    return f"{key.key_size}-bit {kind}" if key.key_size < 2048 else ""


def _when(moment: datetime.datetime) -> str:
    """A certificate date as in the messages: to the second (certificates count no less), in UTC."""
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC"


def _check_dates(tls: TlsSettings, contents: dict[str, bytes]) -> list[tuple[str, str]]:
    """Refuse a server certificate outside its validity period; the warnings to log if the files are used,
    each with the key of its file.

    Clients refuse a certificate that expired or is not yet valid: served, it failed every new connection
    while nereid logged that the files were in use. Only the first certificate of ``cert`` (the server's
    own) is checked: an expired intermediate after it need not break clients (they may find another path,
    as with Let's Encrypt's expired cross-signed root). Likewise a ``client_ca`` bundle may hold expired
    certificates next to valid ones: it is warned about only when none of them is valid now, since then
    every client certificate is refused.
    """
    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    try:
        server = x509.load_pem_x509_certificate(contents["cert"])
    except ValueError as err:  # stricter than OpenSSL, which took it: the dates are not worth refusing it
        log.debug("server.tls.cert: cannot read the validity dates of %s: %s", tls.cert, err)
        return []
    start, end = server.not_valid_before_utc, server.not_valid_after_utc
    period = f"valid from {_when(start)} to {_when(end)}, now {_when(now)}"
    if now > end:
        raise TlsFileError("cert", f"{tls.cert} expired at {_when(end)} ({period}): clients refuse it; "
                                   f"install a renewed certificate")
    if now < start:
        raise TlsNotYetValid("cert", f"{tls.cert} is not valid until {_when(start)} ({period}): clients refuse "
                                     f"it until then (or is this machine's clock wrong?)", start)
    warnings: list[tuple[str, str]] = []
    if end - now < datetime.timedelta(days=EXPIRY_WARNING_DAYS):
        warnings.append(("cert", f"server.tls.cert: {tls.cert} expires at {_when(end)}, in {_left(end - now)} "
                                 f"({period}): clients refuse it from then on; renew it"))
    if "client_ca" in contents:
        try:
            authorities = x509.load_pem_x509_certificates(contents["client_ca"])
        except ValueError:
            authorities = []
        if authorities and not any(ca.not_valid_before_utc <= now <= ca.not_valid_after_utc for ca in authorities):
            dates = "; ".join(f"valid from {_when(ca.not_valid_before_utc)} to {_when(ca.not_valid_after_utc)}"
                              for ca in authorities[:3]) + ("; ..." if len(authorities) > 3 else "")
            warnings.append(("client_ca", f"server.tls.client_ca: no certificate in {tls.client_ca} is valid now "
                                          f"({_when(now)}; {dates}): every client certificate is refused"))
    return warnings


def _left(span: datetime.timedelta) -> str:
    """Time left before expiry, as in the warning: whole days, or hours on the last day."""
    return f"{span.days} days" if span.days >= 1 else f"{span.total_seconds() / 3600:.1f} hours"


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(name: str, content: bytes, warning: str) -> None:
    """Log a WARNING about a file once per process and content: the files are read at start by the
    settings and by each listener, and after a change by each listener; one warning per change is enough."""
    remembered = f"{name}:{hashlib.sha256(content).hexdigest()}"
    with _warned_lock:
        if remembered in _warned:
            return
        _warned.add(remembered)
    log.warning("%s", warning)


def _grpc_serves(cert: bytes, key: bytes) -> bool:
    """Whether gRPC takes this certificate and key (it builds its TLS context when a port is added).

    Python's OpenSSL takes keys that gRPC's BoringSSL does not (DSA, secp256k1, ...): `nereid check` passed
    files that `nereid serve` then failed on, blaming server.bind_addr, and renewed files gRPC could not use
    were announced as served. A gRPC server that is never used adds a port on the loopback with them: about
    3 to 6 ms, paid when the files are checked (reading nereid.yaml, and once per listener when they
    change on disk). When the loopback cannot be bound at all, the answer is yes: the port decides, not
    gRPC's view of the files.
    """
    from concurrent import futures

    import grpc

    def adds_port(credentials: "grpc.ServerCredentials | None") -> bool:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        try:
            if credentials is None:
                return server.add_insecure_port("127.0.0.1:0") != 0
            return server.add_secure_port("127.0.0.1:0", credentials) != 0
        except RuntimeError:  # "Failed to bind to address": gRPC's one answer for anything that went wrong
            return False
        finally:
            server.start()  # a server never started keeps its port open until the process exits
            server.stop(None).wait()

    return adds_port(grpc.ssl_server_credentials([(key, cert)])) or not adds_port(None)


class _EncryptedKey(Exception):
    """Raised by :func:`_no_passphrase`, OpenSSL's passphrase callback: the key is encrypted."""


def _no_passphrase() -> bytes:
    # Without a callback OpenSSL asks for the passphrase on the terminal: `nereid serve` and `nereid check`
    # waited at "Enter PEM pass phrase:" (and a key rotated in while serving stalled the listeners); with
    # no terminal the error was "[Errno 22] Invalid argument".
    raise _EncryptedKey


def _load_cert_chain(context: ssl.SSLContext, tls: TlsSettings) -> None:
    """``context.load_cert_chain`` that never asks for a passphrase; TlsFileError ``key`` when it fails."""
    try:
        context.load_cert_chain(tls.cert, tls.key, password=_no_passphrase)
    except _EncryptedKey:
        raise TlsFileError("key", f"{tls.key} is an encrypted (passphrase-protected) private key, which nereid "
                                  f"does not support: decrypt it into a file only the server can read, e.g. "
                                  f"openssl pkey -in {tls.key} -out decrypted.key, and point server.tls.key at "
                                  f"that file") from None
    except (ssl.SSLError, OSError) as err:
        reason = getattr(err, "reason", None)
        if reason in _TOO_WEAK:
            # Not "is not the private key of ...": the pair matches, OpenSSL refuses it at its security level.
            raise TlsFileError("key" if reason == "EE_KEY_TOO_SMALL" else "cert",
                               f"{tls.cert}: {_TOO_WEAK[reason](tls.cert)} too weak for the HTTP listener's "
                               f"OpenSSL (at its default security level), which refuses to serve with it; use a "
                               f"2048-bit RSA key or more, or an EC key, signed with SHA-256 or better") from None
        raise TlsFileError("key", f"{tls.key} is not the private key of {tls.cert}, or one of them does not "
                                  f"parse: {reason or err}") from None


def _key_size_said(cert: Path) -> str:
    """``its 1024-bit RSA key is``, of the first certificate in ``cert``; ``its key is`` when its size cannot be
    told here (OpenSSL read it)."""
    from cryptography import x509

    try:
        weak = _weak_key(x509.load_pem_x509_certificates(cert.read_bytes())[0])
    except (ValueError, OSError):
        weak = ""
    return f"its {weak} key is" if weak else "its key is"


# OpenSSL's reasons for refusing a certificate and key that match, and what to say of the certificate.
_TOO_WEAK = {
    "EE_KEY_TOO_SMALL": _key_size_said,
    "CA_MD_TOO_WEAK": lambda cert: "its signature's digest (MD5 or SHA-1) is",
}


def server_credentials(tls: TlsSettings) -> "grpc.ServerCredentials":
    """gRPC server credentials that reload the files when they change (mutual TLS with ``client_ca``)."""
    import grpc

    def configuration(material: TlsMaterial) -> "grpc.ServerCertificateConfiguration":
        return grpc.ssl_server_certificate_configuration([(material.key, material.cert)],
                                                         root_certificates=material.client_ca)

    files = _WatchedFiles(tls, "gRPC")
    initial = configuration(read_tls_material(tls))

    def fetch() -> "grpc.ServerCertificateConfiguration | None":
        # Called by gRPC before each new handshake: cheap when nothing changed (a stat per file).
        material = files.changed()
        return None if material is None else configuration(material)

    return grpc.dynamic_ssl_server_credentials(initial, fetch,
                                               require_client_authentication=tls.client_ca is not None)


def ssl_context(tls: TlsSettings) -> ssl.SSLContext:
    """A server-side SSLContext for the HTTP listener that follows the files, as the gRPC credentials do.

    Each new connection is wrapped by the context of the files as they are now: the files are stat-ed
    when it is accepted, and when they changed and still make a usable certificate, it and every later
    connection get a new context built from them. Open connections keep the one they started with.
    Mutual TLS when ``client_ca`` is set.

    A TLS session is resumed only within the context that made it: session tickets (TLS 1.3 and 1.2) are
    sealed with that context's keys and TLS 1.2's session IDs live in its cache, so once the files change
    every client makes a full handshake against them. Switching contexts during the handshake instead
    (an ``sni_callback`` setting ``SSLObject.context``) swaps the certificate and the client CA but not
    the tickets' keys nor the session cache, which stay with the context the listener was given: a
    client whose CA had been removed from client_ca got back in, for ever, by resuming its session.
    """
    return _FollowingContext(tls)


class _FollowingContext(ssl.SSLContext):
    """What the HTTP listener is given: its ``wrap_bio`` (asyncio's, per accepted connection) and
    ``wrap_socket`` wrap with the context of the current files. Its own settings are never used."""

    def __new__(cls, tls: TlsSettings) -> "_FollowingContext":
        return super().__new__(cls, ssl.PROTOCOL_TLS_SERVER)

    def __init__(self, tls: TlsSettings) -> None:
        self._tls = tls
        self._files = _WatchedFiles(tls, "HTTP")
        self._current = _http_context(tls)

    def current(self) -> ssl.SSLContext:
        """The context new connections get: built again when the files changed (a stat per file otherwise)."""
        if self._files.changed() is not None:
            try:
                self._current = _http_context(self._tls)
            except (TlsFileError, ssl.SSLError, OSError) as err:  # changed again since they were checked
                log.error("server.tls: the changed files cannot be used by the HTTP listener (keeping the "
                          "previous certificate): %s", err)
        return self._current

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        return self.current().wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        return self.current().wrap_socket(*args, **kwargs)


def _http_context(tls: TlsSettings) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.sslobject_class = _HandshakeSaysWhy
    _load_cert_chain(context, tls)
    if tls.client_ca is not None:
        context.load_verify_locations(cafile=tls.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
        # A client chain that reaches any certificate of client_ca is let in, as gRPC (BoringSSL) lets it
        # in: a client_ca holding only an intermediate (issuing) CA otherwise refused every client over
        # HTTPS, silently, while gRPC accepted them.
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        # Python 3.13's create_default_context adds VERIFY_X509_STRICT, which refuses a client certificate without an
        # Authority Key Identifier (and other RFC 5280 lapses) that gRPC lets in, and 3.11 and 3.12 let in.
        context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return context


class _HandshakeSaysWhy(ssl.SSLObject):
    """An HTTPS connection's TLS state (asyncio's, through ``wrap_bio``) that logs why a client's handshake failed.

    asyncio says it only in debug mode, and the client is told nothing (the connection just closes): a client
    refused under mutual TLS (no certificate, one from another CA, expired) left no trace on either side (the
    security hunt). Logged at INFO within a limit, as other lines any client can cause; a connection that closes
    mid-handshake (a TCP probe) is not. (gRPC's handshakes are its core's: it tells nothing of them.)
    """

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, ssl.SSLEOFError):
            raise
        except ssl.SSLError as err:
            # (OpenSSL's words, less the line of CPython's _ssl.c they were raised at.)
            why = ("it spoke plain HTTP to the HTTPS listener" if err.reason == "HTTP_REQUEST"
                   else re.sub(r" \(_ssl\.c:\d+\)$", "", str(err)))
            _handshake_log.log(logging.INFO, "HTTPS: a client's TLS handshake failed: %s", why)
            raise


# Failed HTTPS handshakes: any client can cause them at will.
_handshake_log = RateLimitedLog(log)


class _WatchedFiles:
    """The TLS files as one listener last saw them: it acts once per change, before a handshake."""

    def __init__(self, tls: TlsSettings, listener: str) -> None:
        self.tls = tls
        self.listener = listener
        self.stamp = _stamp(tls)
        # When the files last seen hold a certificate not valid yet: when (time.time()) to read them again.
        # Without it a certificate installed ahead of its start was skipped for good: nothing changes on
        # disk when it becomes valid.
        self.retry_at: float | None = None

    def changed(self) -> TlsMaterial | None:
        """The files' checked contents when they changed since the last look; None otherwise.

        Costs a stat per file when nothing changed. Unusable new files are logged
        (naming the key) and skipped: the previous certificate stays in use. A
        certificate not valid yet is read again once it is.
        """
        stamp = _stamp(self.tls)
        if stamp == self.stamp and (self.retry_at is None or time.time() < self.retry_at):
            return None
        # Named by the files that changed: a new cert that does not match the key said "server.tls.key changed".
        changed = ", ".join(f"server.tls.{name}" for name, old, new in zip(self.tls.files(), self.stamp, stamp)
                            if old != new) or "server.tls"
        self.stamp, self.retry_at = stamp, None
        try:
            material = read_tls_material(self.tls)
        except TlsNotYetValid as err:
            self.retry_at = err.valid_from.timestamp()
            log.error("%s changed but cannot be used by the %s listener yet (keeping the previous certificate; "
                      "it is read again at %s unless the files change before): %s",
                      changed, self.listener, _when(err.valid_from), err)
            return None
        except TlsFileError as err:
            log.error("%s changed but cannot be used by the %s listener (keeping the previous certificate): %s",
                      changed, self.listener, err)
            return None
        log.info("server.tls: certificate files changed on disk; new %s connections use them", self.listener)
        return material


def _stamp(tls: TlsSettings) -> tuple:
    stamp = []
    for path in tls.files().values():
        try:
            info = os.stat(path)
            stamp.append((info.st_mtime_ns, info.st_size, info.st_ino))
        except OSError:
            stamp.append(None)
    return tuple(stamp)
