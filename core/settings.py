"""``nereid.yaml``: typed settings, parsed and checked once at start-up.

Every mistake raises :class:`~nereid.errors.ConfigError` with a message of the
form ``<file>: <key path>: <problem>, got <value>``.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import socket
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from nereid.config_document import KeyedReader, load_yaml, quoting_hint, yaml_spelling
from nereid.errors import ConfigError
from nereid.files import NAME_MAX, decode_text, folder_gone, is_model_folder_name, read_regular_file
from nereid.listening import host_and_port
from nereid.storage.mirror import mirror_root
from nereid.storage.url import UserInfoInURL, parse_store_url
from nereid.tls import TlsFileError, TlsSettings, read_tls_material
from nereid.triton_hints import yaml_key_hints

# The configuration file read when none is named (``nereid serve --config FILE`` names another).
DEFAULT_CONFIG_NAME = "nereid.yaml"
DEFAULT_BIND_ADDR = "[::1]:50051"
DEFAULT_QUEUE_CAPACITY = 128
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_SHUTDOWN_GRACE_S = 30.0
DEFAULT_METRICS_ADDR = "127.0.0.1:8002"
DEFAULT_HTTP_ADDR = "[::1]:8000"
DEFAULT_WATCH_SETTLE_MS = 1000.0
DEFAULT_WATCH_POLL_S = 10.0  # how often a watched object store is listed (it sends no events)
DEFAULT_MODEL_LOAD_THREADS = 4  # models loading (and unloading) at once, as Triton's --model-load-thread-count default
MAX_MODEL_LOAD_THREADS = 1024
# Like Triton's default; up to 2 GiB - 1 (gRPC's own ceiling) may be configured.
# nereid.yaml is written by an operator, but a mistake (a binary file, a FIFO) must still be an error.
MAX_CONFIG_BYTES = 4 << 20
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
MAX_MESSAGE_BYTES_CEILING = (1 << 31) - 1
# The largest JSON part of an HTTP infer request (the whole body, or its Inference-Header-Content-Length bytes).
# JSON tensors take 6-31x their size in Python objects while decoded (measured: a 16 MiB body of nested [1]
# lists +497 MiB, of BYTES strings +373 MiB, of floats +90 MiB; at 64 MiB, over 2 GiB, and 4 at once
# OOM-killed a 3 GiB server) and hold the GIL in orjson's parse: 16 MiB keeps one worst-case decode to about
# 500 MiB and 2-4 s of a worker thread. Binary tensors (Triton's binary data extension) carry big data instead,
# as views of the body, up to max_message_bytes.
DEFAULT_HTTP_MAX_JSON_BYTES = 16 << 20
_A_DAY_S = 86_400
# The most a timeout may be: far past any real one, and far below what the waits' C types overflow at.
_LONGEST_WAIT_S = (365 * _A_DAY_S, "a year")

# ASCII digits only, and nothing after (\d takes "٣"; $ lets a trailing newline through).
_DEVICE_PATTERN = re.compile(r"(cpu|cuda)(?::([0-9]+))?")
_ADDRESS_PATTERN = re.compile(r"(\[[^\]]+\]|[^:\[\]]*):([0-9]+)")  # host:port, [v6 host]:port
MAX_PORT = 65535
INT32_MAX = 2**31 - 1  # ModelConfig's counts and sizes are int32 fields
MAX_DEVICE_INDEX = INT32_MAX


# Each section's keys (a key refused in one section is told the section that takes it: see _key_hints).
_TOP_KEYS = frozenset({"server", "models", "backends"})
_SERVER_KEYS = frozenset({"bind_addr", "ml_backends_path", "strict_readiness", "shutdown_grace_s", "metrics_addr",
                          "http_addr", "follow_symlinks", "max_message_bytes", "repository_control", "tls", "watch",
                          "watch_settle_ms", "watch_poll_s", "cache_dir", "http_max_json_bytes", "shutdown_delay_s",
                          "model_load_threads"})
_TLS_KEYS = frozenset({"cert", "key", "client_ca"})
_MODEL_KEYS = frozenset({"name", "device", "queue_capacity", "backend", "instances", "timeout_s", "runtime",
                         "batching"})
_BATCHING_KEYS = frozenset({"enabled", "max_queue_delay_ms", "preferred_batch_sizes", "max_batch_size",
                            "max_batch_cost"})
# Each section by its keys: where a key is written, and how a message says a key was written there.
_SECTIONS = {"top": (_TOP_KEYS, "a top-level key", "at the top level"),
             "server": (_SERVER_KEYS, "a server: setting", "under server:"),
             "tls": (_TLS_KEYS, "a server.tls: setting", "under tls:"),
             "model": (_MODEL_KEYS, "a model entry's key", "in a model entry"),
             "batching": (_BATCHING_KEYS, "a model's batching: setting", "under batching:")}


@functools.cache
def _key_hints(section: str) -> Mapping[str, str]:
    """What the refusal of a key unknown in ``section`` adds for each key another section takes (a ``models:`` list
    indented under ``server:`` was refused with the server's keys alone) or Triton's name for one (see
    :func:`~nereid.triton_hints.yaml_key_hints`, whose words come first)."""
    here = _SECTIONS[section][2]
    hints = {key: f"{key} is {place}, not {here}" for other, (keys, place, _) in _SECTIONS.items() if other != section
             for key in keys}
    return types.MappingProxyType(hints | yaml_key_hints(section))  # (cached: shared by every read)


def key_place(key: str) -> str | None:
    """Where nereid.yaml takes ``key`` ("a model entry's key", "a server: setting"...), when one of its own sections
    does; None otherwise. For the refusal of a ``runtime:`` option that is such a key (``runtime: {backend: cpp}``)."""
    for keys, place, _ in _SECTIONS.values():
        if key in keys:
            return place
    return None


def address_problem(address: str) -> str | None:
    """Why ``address`` is not ``host:port`` with a host and a port of 0-65535; None when it is.

    gRPC wraps a larger port silently (99999 listens on 34463) and the HTTP and
    metrics listeners fail with an OverflowError, so the range is checked here.
    An empty host (``:8000``) failed in gRPC only once serving, and meant every
    interface to the HTTP and metrics listeners: the host is named, always.
    """
    match = _ADDRESS_PATTERN.fullmatch(address)  # (match's $ let a trailing newline through)
    if match is None:
        return "must be host:port"
    if not match.group(1):
        return "must name a host before the port (0.0.0.0 or [::] for every interface)"
    host = match.group(1)
    if host.startswith("[") and not _is_ipv6(host[1:-1]):
        # gRPC takes only an IPv6 address in brackets: [127.0.0.1]:8001 passed nereid check and the HTTP and
        # metrics listeners, then failed gRPC's bind (the config hunt).
        return f"brackets hold an IPv6 address ({host[1:-1]} is none: write it without them)"
    if "%" in host:  # (a zone: the listeners cannot resolve [::1%lo], and serve failed where check passed)
        return f"an IPv6 address with a zone ({host}) cannot be listened on; give the address without it"
    port = match.group(2).lstrip("0")
    if len(port) > len(str(MAX_PORT)) or int(port or "0") > MAX_PORT:  # (int() refuses 4300+ digits)
        return f"port must be 0-{MAX_PORT}"
    return None


def _is_ipv6(text: str) -> bool:
    """Whether ``text`` is an IPv6 address (with or without a zone, ``fe80::1%eth0``)."""
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Device:
    """Where a model runs: ``cpu``, or ``cuda`` with a GPU index."""

    kind: str
    index: int = 0

    @classmethod
    def parse(cls, text: str) -> Device:
        """Parse ``cpu``, ``cuda`` (GPU 0) or ``cuda:<index>``; ValueError otherwise."""
        match = _DEVICE_PATTERN.fullmatch(text)
        if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
            raise ValueError("expected 'cpu', 'cuda' or 'cuda:<index>'")
        index = match.group(2) or "0"
        # ModelConfig's gpus field is an int32: a larger index would fail every ModelConfig call.
        if len(index.lstrip("0")) > 10 or int(index) > MAX_DEVICE_INDEX:
            raise ValueError(f"expected a GPU index of at most {MAX_DEVICE_INDEX}")
        return cls(match.group(1), int(index))

    @property
    def is_gpu(self) -> bool:
        """True for a CUDA device."""
        return self.kind == "cuda"

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


@dataclass(frozen=True)
class BatchingSettings:
    """A model's ``batching:`` section (dynamic batching; see the scheduler).

    ``max_batch_size`` None means the model's own cap (the textproto's
    ``max_batch_size`` or a bundle's largest compiled size); ``max_batch_cost``
    None means no cost budget.
    """

    enabled: bool = True
    max_queue_delay_ms: float = 0.0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_batch_size: int | None = None
    max_batch_cost: int | None = None


@dataclass(frozen=True)
class ModelSettings:
    """One model's entry under ``models:`` (or the defaults for an unlisted folder)."""

    name: str
    device: Device = Device("cpu")
    queue_capacity: int = DEFAULT_QUEUE_CAPACITY
    backend: str | None = None
    instances: int = 1
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    # Backend-specific options, passed through unchecked; each backend checks its own.
    runtime: Mapping[str, Any] = field(default_factory=dict)
    batching: BatchingSettings = BatchingSettings()


@dataclass(frozen=True)
class ServerSettings:
    """The ``server:`` section.

    ``repository_control`` None means automatic: allowed when ``bind_addr``
    and ``http_addr`` (when set) are both loopback (see
    :func:`repository_control_allowed`).
    """

    bind_addr: str = DEFAULT_BIND_ADDR
    ml_backends_path: Path = Path("ml-backends")
    strict_readiness: bool = True
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    metrics_addr: str = DEFAULT_METRICS_ADDR
    follow_symlinks: bool = False
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    repository_control: bool | None = None
    tls: TlsSettings | None = None
    # Dynamic mode: follow ml_backends_path and nereid.yaml (see nereid.watch).
    watch: bool = False
    watch_settle_ms: float = DEFAULT_WATCH_SETTLE_MS
    watch_poll_s: float = DEFAULT_WATCH_POLL_S
    # An object-store ml_backends_path (s3://, gs://, az://; see nereid.storage): then
    # ml_backends_path is its local mirror under cache_dir, where model folders are materialized.
    ml_backends_url: str | None = None
    cache_dir: Path | None = None
    # The KServe V2 REST listener, beside gRPC; "" turns it off.
    http_addr: str = DEFAULT_HTTP_ADDR
    # The largest JSON part of an HTTP infer request (see DEFAULT_HTTP_MAX_JSON_BYTES); binary tensors are
    # bounded by max_message_bytes alone.
    http_max_json_bytes: int = DEFAULT_HTTP_MAX_JSON_BYTES
    # After a stop signal, how long the server reports not ready while still serving everything, before the
    # drain: a load balancer (a Kubernetes Service's endpoints) takes a moment to stop sending it new clients.
    shutdown_delay_s: float = 0.0
    # How many model folders load at once (Triton's --model-load-thread-count): at start with hundreds of
    # folders, every load's thread at once kept the event loop from answering even liveness for seconds.
    model_load_threads: int = DEFAULT_MODEL_LOAD_THREADS


@dataclass(frozen=True)
class Listeners:
    """Addresses given on ``nereid serve``'s command line, each replacing its nereid.yaml key (None: the key's).

    Kept beside the settings rather than written into them: a nereid.yaml
    edited while serving is compared with what the file said, not with flags.
    Each address comes with its origin (``--http-bind``, ``server.http_addr``)
    for the error an address in use gets.
    """

    bind_addr: str | None = None
    http_addr: str | None = None  # "": HTTP off
    metrics_addr: str | None = None  # "": /metrics off

    def grpc(self, server: ServerSettings) -> tuple[str, str]:
        """The gRPC address and where it came from."""
        return (self.bind_addr, "--bind") if self.bind_addr else (server.bind_addr, "server.bind_addr")

    def http(self, server: ServerSettings) -> tuple[str, str]:
        """The HTTP address ("" when off) and where it came from."""
        return ((self.http_addr, "--http-bind") if self.http_addr is not None
                else (server.http_addr, "server.http_addr"))

    def metrics(self, server: ServerSettings) -> tuple[str, str]:
        """The metrics address ("" when off) and where it came from."""
        return ((self.metrics_addr, "--metrics-bind") if self.metrics_addr is not None
                else (server.metrics_addr, "server.metrics_addr"))

    def clash(self, server: ServerSettings, source: Path | str = "") -> str | None:
        """Why two of the listeners would take the same port of the same interface (naming both origins, after
        ``source``, the configuration file's name, when one of them is its), or None.

        Checked before anything binds (by ``nereid serve`` with its flags, and by
        ``nereid check``): the second listener would fail with the system's
        "Address already in use", which blames another process. Ports are
        compared as numbers (port 0 asks for a free one each), hosts as
        addresses (``[::1]`` and ``[0:0:0:0:0:0:0:1]`` alike; ``localhost`` is
        both loopbacks), and a wildcard host (``0.0.0.0``, ``[::]``) takes the
        port on every interface of its family (``[::]`` on IPv4 too, as Linux
        binds it).
        """
        seen: list[tuple[int, frozenset[str], str, str]] = []
        for address, origin in (self.grpc(server), self.http(server), self.metrics(server)):
            if not address:
                continue
            host, port = host_and_port(address)
            if port == 0:
                continue
            hosts = _interfaces(host)
            for other_port, other_hosts, other_address, other_origin in seen:
                if port == other_port and _overlap(hosts, other_hosts):
                    return _clash_message(str(source), (origin, address), (other_origin, other_address))
            seen.append((port, hosts, address, origin))
        return None


def _clash_message(source: str, one: tuple[str, str], other: tuple[str, str]) -> str:
    """The message of two listeners (each ``(origin, address)``: a key of the configuration file ``source``, or a
    flag) that would take one port. A flag's side is told first and the file named only before its own key:
    "prod.yaml: --http-bind: ..." read as a key of the file (the CLI hunt)."""
    if one[0].startswith("--") == other[0].startswith("--"):  # two keys of the file, or two flags
        where = f"{source}: " if source and not one[0].startswith("--") else ""
        (origin, address), (other_origin, other_address) = one, other
    else:
        (origin, address), (other_origin, other_address) = (one, other) if one[0].startswith("--") else (other, one)
        where, other_origin = "", f"{source}'s {other_origin}" if source else other_origin
    return (f"{where}{origin}: {address} would take the port that {other_origin} ({other_address}) takes; each "
            "listener needs an address of its own")


def _interfaces(host: str) -> frozenset[str]:
    """The interfaces a listener on ``host`` binds, as :meth:`Listeners.clash` compares them: one address in its
    canonical spelling; ``localhost`` both loopbacks; a wildcard ``*4``/``*`` (IPv4's, or every family's, as
    ``::`` is on Linux); any other name itself (not resolved: that takes a DNS lookup)."""
    if host.lower() == "localhost":
        return frozenset({"127.0.0.1", "::1"})
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:  # the short IPv4 forms the system takes too ("127.1")
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return frozenset({host.lower()})
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # [::ffff:127.0.0.1] binds 127.0.0.1
    if address.is_unspecified:
        return frozenset({"*"}) if address.version == 6 else frozenset({"*4"})
    return frozenset({address.compressed})


def _overlap(first: frozenset[str], second: frozenset[str]) -> bool:
    """Whether listeners on these interfaces (see :func:`_interfaces`) would take the same port."""
    if first & second or "*" in first | second:
        return True

    def ipv4(hosts: frozenset[str]) -> bool:
        return any("." in host and host.replace(".", "").isdigit() for host in hosts)
    return ("*4" in first and ipv4(second)) or ("*4" in second and ipv4(first))


def is_loopback(bind_addr: str) -> bool:
    """True when ``host:port`` listens on the loopback interface only."""
    host = host_and_port(bind_addr)[0].lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def repository_control_allowed(server: ServerSettings, bind_addr: str) -> bool:
    """Whether RepositoryModelLoad/Unload are served (over gRPC on ``bind_addr``, and over HTTP).

    Unset, they are on only when every listener that serves them is on
    loopback: ``bind_addr`` and, unless HTTP is off, ``http_addr`` (the REST
    port offers the same load and unload). Whoever reaches a public port could
    otherwise unload every model, or load any folder that appears under
    ml_backends_path. Triton's default (model control mode none) is likewise
    closed.
    """
    if server.repository_control is not None:
        return server.repository_control
    return is_loopback(bind_addr) and (not server.http_addr or is_loopback(server.http_addr))


def config_file_name(source: Path | str) -> str:
    """The configuration file ``source`` as messages name it in words ("not listed in prod.yaml"): its base name,
    so that one named nereid.yaml, wherever it is, reads as it always did; DEFAULT_CONFIG_NAME when there is none.

    A mistake at a key names the file's path instead (``<path>: models[0].name: ...``), which locates it."""
    return Path(source).name or DEFAULT_CONFIG_NAME


@dataclass(frozen=True)
class Settings:
    """The whole of ``nereid.yaml``.

    ``models_listed`` is False when the file has no ``models:`` key; every folder
    under ``ml_backends_path`` is then served with default settings.
    """

    source: Path
    server: ServerSettings = field(default_factory=ServerSettings)
    models: tuple[ModelSettings, ...] = ()
    models_listed: bool = False
    # ``backends: {<backend>: {<runtime option>: value}}``: runtime defaults for every model of a backend.
    backend_defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def config_name(self) -> str:
        """The file these settings were read from, as messages name it in words (see :func:`config_file_name`)."""
        return config_file_name(self.source)

    def model(self, name: str) -> ModelSettings | None:
        """The listed settings for ``name``, or None when nereid.yaml does not list it."""
        index = self._listed.get(name)
        return None if index is None else self.models[index]

    def model_or_default(self, name: str) -> tuple[ModelSettings, str]:
        """The settings for ``name`` (defaults when unlisted) and where they come from."""
        index = self._listed.get(name)
        if index is not None:
            return self.models[index], f"{self.source}: models[{index}]"
        return ModelSettings(name), f"{self.source}: (defaults; '{name}' is not listed)"

    @functools.cached_property
    def _listed(self) -> dict[str, int]:
        """Each listed model's index in ``models`` (names are unique): looked up by name rather than scanned,
        which made a start with 20,000 listed models quadratic (the config hunt)."""
        return {model.name: index for index, model in reversed(list(enumerate(self.models)))}


def load_settings(path: Path) -> Settings:
    """Read and check ``nereid.yaml``; relative paths resolve against its folder."""
    path = Path(path)
    # A FIFO, a binary file or a huge one fails with a ConfigError naming the file (never a traceback).
    return settings_from_bytes(read_regular_file(path, MAX_CONFIG_BYTES), path)


def settings_from_bytes(data: bytes, path: Path, read_tls: bool = True) -> Settings:
    """Check nereid.yaml's bytes ``data`` (already read) as if read from ``path``. ``read_tls``: see
    :func:`parse_settings`."""
    document = document_from_bytes(data, path)
    return parse_settings(document if document is not None else {}, path, read_tls)


def document_from_bytes(data: bytes, path: Path) -> Any:
    """nereid.yaml's bytes ``data`` as YAML values (None: no document), as if read from ``path``: bytes that are not
    UTF-8 are explained with the offset of the first bad one."""
    return load_yaml(decode_text(data, path), path)


def parse_settings(document: Any, path: Path, read_tls: bool = True) -> Settings:
    """Check an already-loaded YAML document as if it came from ``path``. ``read_tls`` False leaves the TLS files
    unread: a running server's edit of the file, whose ``server:`` keys wait for a restart (a certificate that
    expired while it served refused every edit of the models; the CLI read hunt)."""
    reader = KeyedReader(path)
    top = reader.mapping(document, "", _TOP_KEYS, _key_hints("top"))
    raw_server = top.get("server", {})
    # (A section left empty, its keys commented out, is YAML's null: no server keys, as for models: and backends:.)
    server = _parse_server(reader, {} if raw_server is None else raw_server, path, read_tls)
    models: list[ModelSettings] = []
    raw_models = top.get("models")
    if "models" in top:
        if raw_models is None:
            raw_models = []
        if not isinstance(raw_models, list):
            reader.fail("models", "must be a list of model entries", raw_models)
        for index, entry in enumerate(raw_models):
            # In dynamic mode a listed model may come before its folder: it loads when the folder lands.
            models.append(_parse_model(reader, entry, f"models[{index}]", server.ml_backends_path,
                                       require_folder=not server.watch and server.ml_backends_url is None))
        seen: set[str] = set()
        for index, model in enumerate(models):
            if model.name in seen:
                reader.fail(f"models[{index}].name", "is listed twice", model.name)
            seen.add(model.name)
    backend_defaults = top.get("backends")
    if backend_defaults is None:  # left out, or a section with its keys commented out
        backend_defaults = {}
    if not isinstance(backend_defaults, dict):
        reader.fail("backends", "must map backend names to their runtime defaults", backend_defaults)
    for backend, defaults in backend_defaults.items():
        if not isinstance(backend, str):  # (`~: {}` was "backends.None: no such backend is installed")
            reader.fail(f"backends.{yaml_spelling(backend)}", f"must be a backend's name{quoting_hint(backend)}",
                        backend)
        if defaults is None:  # its keys commented out, as a section's above
            backend_defaults[backend] = defaults = {}
        if not isinstance(defaults, dict):
            reader.fail(f"backends.{backend}", "must be a mapping of runtime options", defaults)
    return Settings(path, server, tuple(models), models_listed="models" in top, backend_defaults=backend_defaults)


def _parse_server(reader: KeyedReader, raw: Any, path: Path, read_tls: bool = True) -> ServerSettings:
    section = reader.mapping(raw, "server", _SERVER_KEYS, _key_hints("server"))
    bind_addr = _address(reader, section, "server.bind_addr", DEFAULT_BIND_ADDR, off=None)
    backends_text = _path_text(reader, section, "server.ml_backends_path", "ml-backends")
    if not backends_text.strip():  # ("" would serve nereid.yaml's own folder)
        reader.fail("server.ml_backends_path", "must name a folder or a bucket, not be empty", backends_text)
    try:
        location = parse_store_url(backends_text)
    except UserInfoInURL as err:  # (quoted without its secret)
        reader.fail("server.ml_backends_path", str(err), re.sub(r"(://)[^/?#]*@", r"\1<user:password>@",
                                                                backends_text, count=1))
    except ValueError as err:
        reader.fail("server.ml_backends_path", str(err), backends_text)
    cache_dir = _cache_dir(reader, section, path, needed=location is not None)
    if location is not None:  # the model folders are materialized in a local mirror
        assert cache_dir is not None
        backends = mirror_root(cache_dir, location)
    else:
        backends = _home_expanded(backends_text)  # (as cache_dir is: "~/models" was a folder named "~")
        if backends is None:
            reader.fail("server.ml_backends_path", _UNKNOWN_HOME, backends_text)
        if not backends.is_absolute():
            backends = beside_config(path, backends)
        if not backends.is_dir():
            reader.fail("server.ml_backends_path", f"is not a folder ({backends})",
                        section.get("ml_backends_path", "ml-backends"))
    strict = section.get("strict_readiness", True)
    if not isinstance(strict, bool):
        reader.fail("server.strict_readiness", "must be true or false", strict)
    grace = reader.number(section, "server.shutdown_grace_s", DEFAULT_SHUTDOWN_GRACE_S, minimum=0,
                          maximum=_LONGEST_WAIT_S)
    delay = reader.number(section, "server.shutdown_delay_s", 0, minimum=0, maximum=(_A_DAY_S, "a day"))
    metrics_addr = _address(reader, section, "server.metrics_addr", DEFAULT_METRICS_ADDR, off="metrics")
    http_addr = _address(reader, section, "server.http_addr", DEFAULT_HTTP_ADDR, off="HTTP")
    follow = section.get("follow_symlinks", False)
    if not isinstance(follow, bool):
        reader.fail("server.follow_symlinks", "must be true or false", follow)
    max_message = reader.integer(section, "server.max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES, minimum=4096)
    if max_message > MAX_MESSAGE_BYTES_CEILING:
        reader.fail("server.max_message_bytes", f"must be at most {MAX_MESSAGE_BYTES_CEILING} (gRPC's limit)",
                    max_message)
    # Not tied to max_message_bytes: the smaller of the two bounds a JSON body, so either may be lowered alone.
    max_json = reader.integer(section, "server.http_max_json_bytes", DEFAULT_HTTP_MAX_JSON_BYTES, minimum=4096,
                              maximum=(MAX_MESSAGE_BYTES_CEILING, "as max_message_bytes"))
    control = section.get("repository_control")
    if control is not None and not isinstance(control, bool):
        reader.fail("server.repository_control",
                    "must be true or false (unset: true when bind_addr and http_addr are loopback)", control)
    # (tls: with its keys commented out is a section with no keys, as every other: told what it lacks, where it
    # was told it "must be a mapping, got null"; found by the README walkthrough.)
    tls = (_parse_tls(reader, {} if section.get("tls") is None else section["tls"], path, read_tls)
           if "tls" in section else None)
    watch = section.get("watch", False)
    if not isinstance(watch, bool):
        reader.fail("server.watch", "must be true or false", watch)
    settle = reader.number(section, "server.watch_settle_ms", DEFAULT_WATCH_SETTLE_MS, minimum=0,
                           maximum=(_A_DAY_S * 1000, "a day"))
    poll = reader.number(section, "server.watch_poll_s", DEFAULT_WATCH_POLL_S, minimum=0.1,
                         maximum=(_A_DAY_S, "a day"))
    load_threads = reader.integer(section, "server.model_load_threads", DEFAULT_MODEL_LOAD_THREADS, minimum=1,
                                  maximum=(MAX_MODEL_LOAD_THREADS, "one thread each"))
    return ServerSettings(bind_addr, backends, strict, grace, metrics_addr, follow, max_message, control, tls,
                          watch, settle, poll, ml_backends_url=str(location) if location else None,
                          cache_dir=cache_dir, http_addr=http_addr, http_max_json_bytes=max_json,
                          shutdown_delay_s=delay, model_load_threads=load_threads)


def _address(reader: KeyedReader, section: Mapping[str, Any], key: str, default: str, *, off: str | None) -> str:
    """A listener's ``host:port`` (port 0-65535); ``off`` names what ``""`` turns off (None: it must be set)."""
    address = reader.string(section, key, default)
    if off is not None and not address:
        return address
    problem = address_problem(address)
    if problem is not None:
        reader.fail(key, problem if off is None or problem != "must be host:port"
                    else f"must be host:port, or empty to turn {off} off", address)
    return address


def _path_text(reader: KeyedReader, section: Mapping[str, Any], key: str, default: str) -> str:
    """The string at ``key``, a path: a NUL character, which no path can hold, is refused naming the key (it was a
    traceback ending "ValueError: embedded null byte" from the first use of the path; the config hunt)."""
    text = reader.string(section, key, default)
    if "\0" in text:
        reader.fail(key, "must not hold a NUL character (no path can)", text)
    return text


def _cache_dir(reader: KeyedReader, section: Mapping[str, Any], path: Path, needed: bool) -> Path | None:
    """``server.cache_dir``: relative to nereid.yaml; default ``$XDG_CACHE_HOME/nereid`` (``~/.cache/nereid``).

    None when it is not written, no default can be made and nothing ``needed``
    it (only a repository in object storage does): a container's arbitrary
    user id has no home directory, and a local repository must serve there.
    """
    if "cache_dir" in section:
        text = _path_text(reader, section, "server.cache_dir", "")
        if not text:
            reader.fail("server.cache_dir", "must be a folder path", text)
        folder = _home_expanded(text)
        if folder is None:
            if not needed:  # (the reference nereid.yaml writes ~/.cache/nereid: a local repository serves)
                return None
            reader.fail("server.cache_dir", _UNKNOWN_HOME, text)
        return folder if folder.is_absolute() else beside_config(path, folder)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except (RuntimeError, KeyError):  # no HOME, and a user id without a passwd entry
            if not needed:
                return None
            raise ConfigError(f"{path}: server.cache_dir: a repository in object storage is mirrored under it, and "
                              "its default (~/.cache/nereid) has no home directory here (HOME is unset and this "
                              "user has no passwd entry); set server.cache_dir or XDG_CACHE_HOME") from None
    return Path(base) / "nereid"


def beside_config(config: Path, relative: Path) -> Path:
    """A path given relative to nereid.yaml: next to nereid.yaml as named, when something is there; else
    next to the file a symlinked nereid.yaml points to.

    As named first: in a Kubernetes Secret or ConfigMap every file is a symlink
    through ``..data`` into a versioned folder that each update replaces, so a
    path resolved into that folder (``..2026_v1/tls.crt``) would stop following
    updates, and vanish with the next one. A nereid.yaml symlinked from
    elsewhere still finds what sits beside the real file.
    """
    named = Path(os.path.abspath(config)).parent / relative  # (abspath: as the watcher names it on re-reads)
    if os.path.lexists(named):  # (a dangling symlink too: it is what was named)
        return named
    return config.resolve().parent / relative


def _parse_tls(reader: KeyedReader, raw: Any, path: Path, read: bool = True) -> TlsSettings:
    section = reader.mapping(raw, "server.tls", _TLS_KEYS, _key_hints("tls"))
    files: dict[str, Path | None] = {}
    for key in ("cert", "key", "client_ca"):
        if key not in section:
            if key != "client_ca":
                reader.fail(f"server.tls.{key}", "is required (a PEM file)", None)
            files[key] = None
            continue
        text = _path_text(reader, section, f"server.tls.{key}", "")
        if not text:
            reader.fail(f"server.tls.{key}", "must be a file path", text)
        file = Path(text)
        files[key] = file if file.is_absolute() else beside_config(path, file)
    tls = TlsSettings(files["cert"], files["key"], files["client_ca"])
    try:
        if read:
            read_tls_material(tls)
    except TlsFileError as err:
        reader.fail(f"server.tls.{err.key}", str(err), section.get(err.key))
    return tls


def _parse_model(reader: KeyedReader, raw: Any, where: str, backends_path: Path,
                 require_folder: bool = True) -> ModelSettings:
    entry = reader.mapping(raw, where, _MODEL_KEYS, _key_hints("model"))
    if "name" not in entry:
        reader.fail(f"{where}.name", "is required", None)
    name = reader.string(entry, f"{where}.name", "")
    if not is_model_folder_name(name):
        reader.fail(f"{where}.name", f"must be a folder name (not empty or hidden, no '/' or NUL, at most "
                                     f"{NAME_MAX} bytes)", name)
    # (A folder the server's user cannot look at is its load's to report: see folder_gone.)
    if require_folder and folder_gone(backends_path / name):
        reader.fail(f"{where}.name", f"has no model folder {backends_path / name}", name)
    device_text = reader.string(entry, f"{where}.device", "cpu")
    try:
        device = Device.parse(device_text)
    except ValueError as err:
        reader.fail(f"{where}.device", str(err), device_text)
    # (A meta model's ModelConfig gives its queue_capacity as its instance count: concurrent orchestrations.)
    capacity = reader.integer(entry, f"{where}.queue_capacity", DEFAULT_QUEUE_CAPACITY, minimum=1,
                              maximum=(INT32_MAX, "a meta model's ModelConfig gives it as its instance_group "
                                                  "count, an int32"))
    instances = reader.integer(entry, f"{where}.instances", 1, minimum=1,
                               maximum=(INT32_MAX, "ModelConfig's instance_group count is an int32"))
    backend = entry.get("backend")
    if backend is not None and (not isinstance(backend, str) or not backend):
        reader.fail(f"{where}.backend", f"must be a backend name{quoting_hint(backend)}", backend)
    timeout: float | None = DEFAULT_TIMEOUT_S
    if "timeout_s" in entry and entry["timeout_s"] is None:
        timeout = None
    else:
        timeout = reader.number(entry, f"{where}.timeout_s", DEFAULT_TIMEOUT_S, minimum=0, exclusive=True,
                                maximum=_LONGEST_WAIT_S)
    # (None: the section is there with its keys commented out, as a top-level one may be)
    runtime = _section_or_empty(entry, "runtime")
    if not isinstance(runtime, dict):
        reader.fail(f"{where}.runtime", "must be a mapping of backend options", runtime)
    batching = _parse_batching(reader, _section_or_empty(entry, "batching"), f"{where}.batching")
    return ModelSettings(name, device, capacity, backend, instances, timeout, runtime, batching)


_UNKNOWN_HOME = ("starts with ~, but that home directory is not known here (HOME is unset and this user has no "
                 "passwd entry, or ~name names no user); give an absolute path")


def _home_expanded(text: str) -> Path | None:
    """``text`` as a path, a leading ``~`` or ``~name`` made the home directory; None when that is not known."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        return None


def _section_or_empty(entry: dict, key: str) -> Any:
    """``entry[key]``; {} where it is left out, or written with no keys (YAML reads ``batching:`` as null)."""
    section = entry.get(key)
    return {} if section is None else section


def _parse_batching(reader: KeyedReader, raw: Any, where: str) -> BatchingSettings:
    section = reader.mapping(raw, where, _BATCHING_KEYS, _key_hints("batching"))
    enabled = section.get("enabled", True)
    if not isinstance(enabled, bool):
        reader.fail(f"{where}.enabled", "must be true or false", enabled)
    delay = reader.number(section, f"{where}.max_queue_delay_ms", 0.0, minimum=0,
                          maximum=(_A_DAY_S * 1000, "a day"))
    preferred = section.get("preferred_batch_sizes", [])
    if not isinstance(preferred, list) or any(isinstance(p, bool) or not isinstance(p, int) or p < 1
                                              for p in preferred):
        reader.fail(f"{where}.preferred_batch_sizes", "must be a list of positive integers", preferred)
    if any(p > INT32_MAX for p in preferred):
        reader.fail(f"{where}.preferred_batch_sizes", f"must hold sizes of at most {INT32_MAX} (ModelConfig's "
                    "preferred_batch_size is an int32)", preferred)
    cap = (reader.integer(section, f"{where}.max_batch_size", 1, minimum=1,
                          maximum=(INT32_MAX, "ModelConfig's max_batch_size is an int32"))
           if "max_batch_size" in section else None)
    if cap is not None and any(p > cap for p in preferred):
        reader.fail(f"{where}.preferred_batch_sizes", f"must not exceed max_batch_size {cap}", preferred)
    cost = reader.integer(section, f"{where}.max_batch_cost", 1, minimum=1) if "max_batch_cost" in section else None
    return BatchingSettings(enabled, delay, tuple(sorted(set(preferred))), cap, cost)
