"""A real S3 API on the loopback for the tests: moto's server, with credentials and injectable faults.

moto answers the S3 REST API exactly as the client sees AWS (obstore's own
request signing, listing, ranged GETs, ETags), so nereid runs its real code
path against it. Around moto's WSGI application sit two test-only layers:

* an access-key check: a request signed with a key other than ``ACCESS_KEY``
  is answered ``403 InvalidAccessKeyId`` in S3's XML, as AWS answers it
  (moto's own IAM signature checking refuses obstore's list requests);
* faults: ``S3Server.fail(key, range, times, kind)`` makes the next ``times``
  GETs of that object (and Range header) fail with a 500, or answer only
  the first half of the range asked for; ``S3Server.get_latency_s`` delays
  every GET's answer, as a remote store's first byte is (for benchmarks).

Every request's method, path and Range header is recorded (``requests``).
The server binds 127.0.0.1 on a free port, never another address.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

ACCESS_KEY = "NEREIDTESTKEY"
SECRET_KEY = "nereid-test-secret"
REGION = "us-east-1"
BUCKET = "models"


@dataclass
class Fault:
    key: str
    range: str | None
    times: int
    kind: str = "error"  # "error": 500 InternalError; "short": a valid answer with half of the range (ranged GETs only)


@dataclass
class S3Server:
    """The running server: its endpoint, the recorded requests and the armed faults."""

    endpoint: str
    prefix: str = ""  # the current test's own prefix in the bucket
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    get_latency_s: float = 0.0  # added before every GET's answer (a remote store's first-byte latency)

    def env(self, **overrides: str) -> dict[str, str]:
        """The environment variables obstore reads to reach this server."""
        values = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                  "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION}
        values.update(overrides)
        return values

    @property
    def store(self):
        """An obstore store on the bucket, for the tests' own uploads and listings."""
        from obstore.store import S3Store

        return S3Store(BUCKET, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                       region=REGION, client_options={"allow_http": True})

    def url(self, *parts: str) -> str:
        """``s3://models/<this test's prefix>/<parts>``."""
        return "/".join([f"s3://{BUCKET}/{self.prefix}", *parts])

    def fail(self, key: str, range_header: str | None = None, times: int = 1, kind: str = "error") -> Fault:
        """Make the next ``times`` GETs of ``key`` (with exactly this Range header, if given) fail."""
        fault = Fault(key, range_header, times, kind)
        with self.lock:
            self.faults.append(fault)
        return fault

    def gets(self, key: str) -> list[str | None]:
        """The Range headers of this test's GETs of ``<prefix>/<key>``, in order."""
        path = f"/{BUCKET}/{self.prefix}/{key.lstrip('/')}"
        with self.lock:
            return [r for method, p, r in self.requests if method == "GET" and p == path]

    def _take_fault(self, method: str, path: str, range_header: str | None) -> Fault | None:
        with self.lock:
            self.requests.append((method, path, range_header))
            for fault in self.faults:
                if (method == "GET" and fault.times > 0 and path.endswith("/" + fault.key)
                        and fault.range in (None, range_header)
                        and (fault.kind != "short" or range_header is not None)):  # half of a range: needs one
                    fault.times -= 1
                    return fault
        return None


_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/")


def _error(start_response, status: str, code: str, message: str) -> list[bytes]:
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f'</Error>').encode()
    start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
    return [body]


def start_server() -> tuple[S3Server, object, threading.Thread]:
    """Start moto's S3 on 127.0.0.1:<free port> with the layers above; returns the server and its handle."""
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import WSGIRequestHandler, make_server

    moto_app = DomainDispatcherApplication(create_backend_app)
    state = S3Server(endpoint="")

    def app(environ, start_response):
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        authorization = environ.get("HTTP_AUTHORIZATION", "")
        match = _CREDENTIAL.search(authorization)
        if match is not None and match.group(1) != ACCESS_KEY:
            return _error(start_response, "403 Forbidden", "InvalidAccessKeyId",
                          "The AWS Access Key Id you provided does not exist in our records.")
        fault = state._take_fault(method, path, environ.get("HTTP_RANGE"))
        if method == "GET" and state.get_latency_s:
            time.sleep(state.get_latency_s)
        if fault is not None and fault.kind == "error":
            return _error(start_response, "500 Internal Server Error", "InternalError", "injected by the test")
        if fault is not None and fault.kind == "short":  # a well-formed answer with half the bytes asked for
            first, last = (int(v) for v in environ["HTTP_RANGE"].removeprefix("bytes=").split("-"))
            environ = {**environ, "HTTP_RANGE": f"bytes={first}-{first + (last - first) // 2}"}
        return moto_app(environ, start_response)

    class Quiet(WSGIRequestHandler):
        def log_request(self, *args, **kwargs) -> None:
            pass

    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=Quiet)
    state.endpoint = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, name="moto-s3", daemon=True)
    thread.start()
    import boto3  # moto's own dependency: the bucket is created the way AWS's tools create one

    boto3.client("s3", endpoint_url=state.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                 aws_secret_access_key=SECRET_KEY).create_bucket(Bucket=BUCKET)
    return state, server, thread


def upload_folder(store, local: Path, prefix: str) -> list[str]:
    """Put every file under ``local`` at ``prefix/<relative path>``; returns the keys."""
    import obstore

    keys = []
    for path in sorted(p for p in Path(local).rglob("*") if p.is_file()):
        relative = path.relative_to(local).as_posix()
        if relative.startswith(".cache/"):
            continue
        key = f"{prefix}/{relative}"
        obstore.put(store, key, path.read_bytes())
        keys.append(key)
    return keys


def bucket_state(store, prefix: str = "") -> dict[str, tuple[int, str]]:
    """Every object under ``prefix``: key -> (size, ETag)."""
    import obstore

    return {o["path"]: (o["size"], o["e_tag"]) for chunk in obstore.list(store, prefix or None) for o in chunk}


def iter_files(folder: Path) -> Iterator[Path]:
    """Every file under ``folder``."""
    return (p for p in Path(folder).rglob("*") if p.is_file())
