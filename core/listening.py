"""Listening sockets for the HTTP and metrics listeners, taking an address as the gRPC listener takes it;
and the probe of whether gRPC can bind its own address (:func:`bind_problem`).

``[::]`` means every interface: one dual-stack socket (IPV6_V6ONLY off, whatever
the host's ``net.ipv6.bindv6only`` says, so IPv4 clients such as a kubelet's
probes reach it too), or IPv4's ``0.0.0.0`` alone on a host without IPv6. A
name (``localhost``) is listened on at every address it resolves to, one port
for all of them; an address family the host lacks is passed over, an address in
use is not.
"""

from __future__ import annotations

import errno
import socket

# What a host without IPv6 (or without one of a name's addresses) answers: that address is passed over.
_ABSENT = (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL)
_PORT_0_ATTEMPTS = 8


def host_and_port(address: str) -> tuple[str, int]:
    """The host (an IPv6 address's brackets taken off) and the port of ``host:port``, as the settings accept
    it (:func:`nereid.settings.address_problem`): ``[::1]:8000`` is ``("::1", 8000)``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def cannot_listen(address: str, origin: str, why: OSError | str | None = None) -> OSError:
    """The error of a listener that cannot listen on ``address`` (from ``origin``, a nereid.yaml key or a flag),
    with the system's reason. An IPv6 address the host does not have is said to be one: nereid's defaults are
    ``[::1]``, and a container without IPv6 (Docker's default network) refused them with only "Cannot assign
    requested address" (the operator hunt)."""
    reason = f": {why.strerror or why}" if isinstance(why, OSError) else f": {why}" if why else ""
    host, _ = host_and_port(address)
    if isinstance(why, OSError) and why.errno in _ABSENT and ":" in host and host != "::":
        reason += " (this host has no IPv6 address there: listen on 127.0.0.1 or 0.0.0.0 instead)"
    return OSError(f"cannot listen on {address} ({origin}){reason}")


def with_port(address: str, port: int) -> str:
    """``address`` (``host:port``, as configured) with the port it was bound to: the one to connect to when it
    asked for 0 (the log said ``http://localhost:0/metrics``; the operator hunt)."""
    host, _ = host_and_port(address)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound sockets (not listening yet) for ``host`` (brackets stripped) and ``port``; OSError when none binds.

    Each has SO_REUSEADDR, and TCP_NODELAY, which accepted connections inherit:
    without it, a response written in two parts waits for the client's delayed
    ACK (40 ms) before its second part leaves (Nagle's algorithm).
    """
    if host == "::":
        try:
            return [_bound(socket.AF_INET6, ("::", port, 0, 0), dual_stack=True)]
        except OSError as err:
            if err.errno not in _ABSENT:
                raise
            return [_bound(socket.AF_INET, ("0.0.0.0", port))]
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = list(dict.fromkeys((family, sockaddr) for family, _, _, _, sockaddr in found))
    # Port 0: the free port the first address was given may be taken on another one; then another free port.
    attempts_left = _PORT_0_ATTEMPTS if port == 0 and len(addresses) > 1 else 1
    while True:
        attempts_left -= 1
        try:
            return _bind_each(addresses, port)
        except OSError as err:
            if err.errno != errno.EADDRINUSE or not attempts_left:
                raise


def _bind_each(addresses: list[tuple[socket.AddressFamily, tuple]], port: int) -> list[socket.socket]:
    """A socket bound to each of ``addresses``, on one port; closes what it bound when one fails."""
    bound: list[socket.socket] = []
    absent: OSError | None = None
    try:
        for family, sockaddr in addresses:
            if bound and port == 0:  # the port the first one was given, for every address of the name
                sockaddr = (sockaddr[0], bound[0].getsockname()[1], *sockaddr[2:])
            try:
                bound.append(_bound(family, sockaddr))
            except OSError as err:
                if err.errno not in _ABSENT:
                    raise
                absent = absent or err
    except OSError:
        for sock in bound:
            sock.close()
        raise
    if not bound:
        assert absent is not None  # (getaddrinfo gives at least one address or raises)
        raise absent
    return bound


def _bound(family: socket.AddressFamily, sockaddr: tuple, dual_stack: bool = False) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if dual_stack:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(sockaddr)
    except OSError:
        sock.close()
        raise
    return sock


def bind_problem(address: str) -> OSError | None:
    """Why gRPC could not listen on ``host:port``, found by binding it as gRPC does; None when it can.

    gRPC sets SO_REUSEADDR (a port in TIME_WAIT is no problem) and, with
    ``grpc.so_reuseport`` 0, nothing more; it listens on a wildcard host (0.0.0.0
    or ::) through one dual-stack socket, or on IPv4 alone where that fails, and
    on a name on every address it resolves to, succeeding when one binds. The
    probe does the same, and closes its sockets at once.
    """
    host, port = host_and_port(address)
    candidates: list[tuple[socket.AddressFamily, tuple]]
    if host in ("0.0.0.0", "::"):
        candidates = [(socket.AF_INET6, ("::", port, 0, 0)), (socket.AF_INET, ("0.0.0.0", port))]
    else:
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError as err:  # (socket.gaierror: a name that does not resolve)
            return err
        candidates = [(family, sockaddr) for family, _, _, _, sockaddr in found]
    first: OSError | None = None
    for family, sockaddr in candidates:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and sockaddr[0] == "::":
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual-stack, as gRPC's
                probe.bind(sockaddr)
                probe.listen(1)
            return None
        except OSError as err:
            first = first or err
            if host == "::" and err.errno not in _ABSENT:
                # [::] asked for, its IPv6 side taken (another server on [::1] or [::] at this port): gRPC would fall
                # back to 0.0.0.0 and start on IPv4 alone, saying it listens on [::], while IPv6 clients reach the
                # other server (the replicas hunt). Refused, as the HTTP listener refuses it; only a host without
                # IPv6 falls back. (0.0.0.0 asks for IPv4: its fallback is what was asked for.)
                return err
    return first
