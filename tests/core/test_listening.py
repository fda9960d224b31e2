"""Listening sockets for HTTP and metrics: ``[::]`` is every interface, IPv4 too, also on a host without IPv6.

Defects: ``[::]`` made an IPv6-only socket where the host's net.ipv6.bindv6only
is 1 (a kubelet's IPv4 probes were refused), and on a host without IPv6 it
stopped ``nereid serve`` with `[Errno 97] Address family not supported by
protocol`, naming no address; gRPC's listener took both cases.
"""

from __future__ import annotations

import errno
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nereid.listening import bind_listening_sockets, bind_problem, host_and_port
from support import both_loopbacks


def connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def test_an_address_is_split_into_its_host_without_brackets_and_its_port():
    assert host_and_port("[::1]:8000") == ("::1", 8000)
    assert host_and_port("[::ffff:127.0.0.1]:0") == ("::ffff:127.0.0.1", 0)
    assert host_and_port("0.0.0.0:8001") == ("0.0.0.0", 8001)
    assert host_and_port("localhost:08002") == ("localhost", 8002)


def test_the_ipv6_wildcard_is_one_dual_stack_socket_whatever_the_hosts_default():
    (sock,) = bind_listening_sockets("::", 0)
    with sock:
        sock.listen()
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0  # set, not the sysctl's default
        port = sock.getsockname()[1]
        assert connects("127.0.0.1", port) and connects("::1", port)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


def test_a_name_is_listened_on_at_every_address_it_resolves_to_on_one_port(monkeypatch):
    both_loopbacks(monkeypatch)
    sockets = bind_listening_sockets("loopbacks", 0)
    try:
        assert [sock.family for sock in sockets] == [socket.AF_INET6, socket.AF_INET]
        (port,) = {sock.getsockname()[1] for sock in sockets}
        for sock in sockets:
            sock.listen()
        assert connects("::1", port) and connects("127.0.0.1", port)
    finally:
        for sock in sockets:
            sock.close()


def test_one_address_of_a_name_in_use_is_an_error_and_closes_what_had_bound(monkeypatch):
    both_loopbacks(monkeypatch)
    with socket.socket(socket.AF_INET) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as refused:
            bind_listening_sockets("loopbacks", port)
        assert refused.value.errno == errno.EADDRINUSE
        # The ::1 socket bound first was closed: the port is free there.
        with socket.socket(socket.AF_INET6) as again:
            again.bind(("::1", port))


def test_an_address_in_use_is_an_error_not_passed_over():
    # [::] must not fall back to 0.0.0.0 when IPv4's wildcard is another server's.
    with socket.socket(socket.AF_INET) as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        for host in ("::", "0.0.0.0", "127.0.0.1"):
            with pytest.raises(OSError) as refused:
                bind_listening_sockets(host, taken.getsockname()[1])
            assert refused.value.errno == errno.EADDRINUSE, host


SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/socket.h>
/* A kernel booted with ipv6.disable=1: no AF_INET6 socket can be made. */
int socket(int domain, int type, int protocol) {
    static int (*real)(int, int, int);
    if (!real) real = dlsym(RTLD_NEXT, "socket");
    if (domain == AF_INET6) { errno = EAFNOSUPPORT; return -1; }
    return real(domain, type, protocol);
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the no-IPv6 shim")
def test_the_ipv6_wildcard_is_ipv4_s_on_a_host_without_ipv6(tmp_path: Path):
    (tmp_path / "noinet6.c").write_text(SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "noinet6.so"), str(tmp_path / "noinet6.c"),
                    "-ldl"], check=True)
    probe = ("import json, socket\nfrom nereid.listening import bind_listening_sockets\n"
             "(sock,) = bind_listening_sockets('::', 0)\n"
             "print(json.dumps([sock.family == socket.AF_INET, sock.getsockname()[0]]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          env={"LD_PRELOAD": str(tmp_path / "noinet6.so"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [True, "0.0.0.0"]


def test_grpc_s_address_is_probed_as_grpc_binds_it():
    """The probe serve makes before gRPC binds: what is free is no problem, an address in use or a name that
    does not resolve is (a port in TIME_WAIT is not: SO_REUSEADDR, as gRPC sets it)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        problem = bind_problem(f"127.0.0.1:{port}")
        assert isinstance(problem, OSError) and problem.errno == errno.EADDRINUSE
    assert bind_problem(f"127.0.0.1:{port}") is None  # let go
    assert isinstance(bind_problem("no-such-host.invalid:8001"), socket.gaierror)


def test_the_grpc_ipv6_wildcard_taken_on_ipv6_is_a_problem_not_a_start_on_ipv4_alone():
    """Found by the replicas hunt: with another server on [::1]:P, a second one told [::]:P started (gRPC fell back
    to 0.0.0.0), said it listened on [::]:P, and IPv6 clients reached the other server; the HTTP listener refuses
    the same address."""
    try:
        taken = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        pytest.skip("no IPv6 here")
    with taken:
        try:
            taken.bind(("::1", 0))
        except OSError:
            pytest.skip("no ::1 here")
        taken.listen(1)
        port = taken.getsockname()[1]
        problem = bind_problem(f"[::]:{port}")
        assert isinstance(problem, OSError) and problem.errno == errno.EADDRINUSE, problem
        # 0.0.0.0 asks for IPv4 alone, which gRPC's fallback gives (the hunt of the fix: refused too, it was a
        # regression, though nereid check passed such a config).
        assert bind_problem(f"0.0.0.0:{port}") is None
    assert bind_problem(f"[::]:{port}") is None  # let go


def test_an_ipv6_address_the_host_lacks_is_said_to_be_one():
    """The operator hunt: in a container without IPv6 the default [::1] addresses were refused with only "Cannot
    assign requested address". (2001:db8::/32 is for documentation: no host has it.)"""
    from nereid.listening import bind_problem, cannot_listen
    from nereid.metrics_endpoint import MetricsEndpoint
    from prometheus_client import CollectorRegistry

    with pytest.raises(OSError) as refused:
        MetricsEndpoint(CollectorRegistry()).serve("[2001:db8::1]:0")
    assert str(refused.value).startswith("cannot listen on [2001:db8::1]:0 (server.metrics_addr): ")
    assert str(refused.value).endswith("(this host has no IPv6 address there: listen on 127.0.0.1 or 0.0.0.0 instead)")
    problem = bind_problem("[2001:db8::1]:0")  # as gRPC's address is probed
    assert problem is not None and "no IPv6 address there" in str(cannot_listen("[2001:db8::1]:0", "--bind", problem))
    assert "IPv6" not in str(cannot_listen("192.0.2.1:0", "--bind", bind_problem("192.0.2.1:0")))
