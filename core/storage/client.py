"""obstore stores, their errors in words, and bounded-retry parallel ranged reads.

Credentials and endpoints come from the environment variables obstore reads
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``,
``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP``, ``GOOGLE_*``, ``AZURE_*``). The store
is built anew for each load, so a fixed variable takes effect at the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Coroutine, Iterator, Mapping, Sequence
from urllib.parse import urlsplit

from nereid.errors import ConfigError, cap_message
from nereid.storage.url import StoreURL

# Listing and small files: obstore's own retries, bounded in count and time, so
# an unreachable store fails a load in seconds rather than minutes.
DEFAULT_RETRIES = 3
_RETRY_TIMEOUT = timedelta(seconds=20)
_CREDENTIAL_HINT = {
    "s3": "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL, AWS_REGION)",
    "gs": "check GOOGLE_SERVICE_ACCOUNT / GOOGLE_APPLICATION_CREDENTIALS",
    "az": "check AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT_KEY (or another AZURE_* credential)",
}

_ALLOW_HTTP_HINT = {"s3": "set AWS_ALLOW_HTTP=true for a plain-http endpoint (AWS_ENDPOINT_URL=http://...)",
                    "gs": "set GOOGLE_ALLOW_HTTP=true for a plain-http endpoint (GOOGLE_BASE_URL=http://...)",
                    "az": "set AZURE_ALLOW_HTTP=true for a plain-http endpoint (AZURE_STORAGE_ENDPOINT=http://...)"}
# Where a store that cannot be reached is configured, by scheme (gs:// and az:// were told of AWS_ENDPOINT_URL).
_ENDPOINT_HINT = {"s3": "AWS_ENDPOINT_URL, and AWS_ALLOW_HTTP for http://",
                  "gs": "GOOGLE_BASE_URL, and GOOGLE_ALLOW_HTTP for http://",
                  "az": "AZURE_STORAGE_ENDPOINT, and AZURE_ALLOW_HTTP for http://"}
# The variable that lets the store client take a certificate no CA vouches for, by scheme.
_INVALID_CERTIFICATES = {"s3": "AWS_ALLOW_INVALID_CERTIFICATES", "gs": "GOOGLE_ALLOW_INVALID_CERTIFICATES",
                         "az": "AZURE_ALLOW_INVALID_CERTIFICATES"}
# The variables obstore reads a store's endpoint from, by scheme (AWS_ENDPOINT_URL_S3 wins over the others).
# obstore panics on a malformed one at the first request instead of raising an error.
ENDPOINT_VARIABLES = {"s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"), "gs": ("GOOGLE_BASE_URL",),
                      "az": ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")}
# The variables obstore reads as booleans, by scheme. It takes 1, true, on, yes, y and 0, false, off, no, n (any
# case), and refuses anything else naming only the value ("failed to parse "" as boolean"): an empty one, common
# from templated environments (Helm's `value: ""`), failed every load without saying which variable it was.
BOOLEAN_VARIABLES = {
    "s3": ("AWS_ALLOW_HTTP", "AWS_ALLOW_INVALID_CERTIFICATES", "AWS_SKIP_SIGNATURE", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST",
           "AWS_S3_EXPRESS", "AWS_UNSIGNED_PAYLOAD", "AWS_REQUEST_PAYER", "AWS_DISABLE_TAGGING", "AWS_HTTP1_ONLY",
           "AWS_HTTP2_ONLY"),
    "gs": ("GOOGLE_ALLOW_HTTP", "GOOGLE_ALLOW_INVALID_CERTIFICATES", "GOOGLE_SKIP_SIGNATURE", "GOOGLE_HTTP1_ONLY",
           "GOOGLE_HTTP2_ONLY"),
    "az": ("AZURE_ALLOW_HTTP", "AZURE_ALLOW_INVALID_CERTIFICATES", "AZURE_SKIP_SIGNATURE", "AZURE_USE_FABRIC_ENDPOINT",
           "AZURE_DISABLE_TAGGING", "AZURE_STORAGE_USE_EMULATOR", "AZURE_HTTP1_ONLY", "AZURE_HTTP2_ONLY"),
}
_BOOLEAN_SPELLINGS = frozenset({"1", "true", "on", "yes", "y", "0", "false", "off", "no", "n"})
# Two spellings of one setting: obstore takes whichever comes last in the process's environment, so two that
# disagree reach a store that depends on their order (and the mirror, named after the first, would be shared
# with another store's). AWS_ENDPOINT_URL_S3 is no alias: it wins over both, as the AWS SDKs have it.
ENDPOINT_ALIASES = {"s3": ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"), "az": ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")}
# A URL's start that is certainly no user name: "http:" or "https:" and any slashes ("http:/host", a slip, too),
# or another scheme and "//" (in "op:pw@host", "op:" is a user name, not a scheme).
_SCHEME = r"(?:https?:/*|[a-z][a-z0-9+.-]*://+)"
_ENDPOINT_SCHEME = re.compile(rf"(?i)^\s*{_SCHEME}")
# "user:password@" in a URL, up to the host's last "@", and the values of query parameters that carry a
# signature or a token.
_USERINFO = re.compile(rf"(?i)\b({_SCHEME})[^/\s]*@")
# Which characters a user name or password in an endpoint must hold percent-encoded, said once.
_USERINFO_HINT = ("a '/', '?', '#', '@' or '\\' in a user name or password must be percent-encoded as "
                  "%2F, %3F, %23, %40, %5C")
_SECRET_PARAMETER = re.compile(r"(?i)([?&](?:[a-z0-9-]*(?:signature|credential|token)[a-z0-9-]*|sig)=)[^&#\s]*")


class StorageError(ConfigError):
    """An object-store operation failed; the message names the URL and the cause."""


def store_failed(error: BaseException) -> bool:
    """Whether the object store caused ``error``: a StorageError, or an error raised from or while handling one
    (a backend that wraps its weights stream's failure, the load that could not list the store)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, StorageError):
            return True
        seen.add(id(current))
        # What it was raised from; else what it was raised while handling, unless it said not to (``from None``):
        # a cleanup's error is no store's doing.
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return False


_UNREACHABLE = "cannot reach the store"


def store_unreachable(error: StorageError) -> bool:
    """Whether ``error`` says the store could not be reached at all (refused, unresolved, timed out): a second
    request to it now would fail the same way, after as long (30 s for a store that hangs)."""
    return _UNREACHABLE in str(error)


def failure_kind(reason: str) -> str:
    """A store failure's ``reason`` without its counts and timings, to tell a new reason from the same one again:
    the store client's words time each try ("in 425.37ms, after 3 retries").

    An HTTP status stays (a 403 after a 500 is news), and so do digits within a word (``model.b8`` is not
    ``model.b32``).
    """
    return _COUNT_OR_TIMING.sub("#", reason)


# A number standing on its own (or leading a unit: "425.37ms"), unless it is an HTTP status.
_COUNT_OR_TIMING = re.compile(r"(?<!HTTP )\b\d+(\.\d+)?")


class StoreClientPanic(StorageError):
    """obstore's Rust code panicked (a PanicException, which ``except Exception`` does not catch)."""


def open_store(location: StoreURL, *, max_retries: int = DEFAULT_RETRIES) -> Any:
    """An obstore store for ``location``'s bucket (keys are then full object keys).

    StorageError when obstore is missing, an endpoint variable is malformed or
    obstore refuses its configuration.
    """
    try:
        from obstore.store import from_url
    except ImportError:  # a dependency, but say so plainly if it is missing
        raise StorageError(f"{location}: reading models from object storage needs obstore "
                           "(pip install obstore)") from None
    problem = (endpoint_problem(location.scheme) or boolean_problem(location.scheme)
               or header_value_problem(location.scheme))
    if problem is not None:
        raise StorageError(f"{location}: cannot set up the store: {problem}")
    try:
        # No client_options: passing any replaces those obstore reads from the environment
        # (AWS_ALLOW_HTTP among them); its defaults bound a request to 30 s, a connection to 5 s.
        with store_call(location.scheme):
            return from_url(location.bucket_url,
                            retry_config={"max_retries": max_retries, "retry_timeout": _RETRY_TIMEOUT,
                                          "backoff": {"init_backoff": timedelta(milliseconds=100),
                                                      "max_backoff": timedelta(seconds=2), "base": 2.0}})
    except Exception as err:  # a bad configuration variable, an unsupported option
        raise StorageError(f"{location}: cannot set up the store: {describe_error(err, location.scheme)}") from None


def endpoint_problem(scheme: str) -> str | None:
    """What is wrong with the endpoint variable obstore would read for ``scheme``; None when nothing is.

    An endpoint must be an http:// or https:// URL with a host and no
    whitespace: obstore panics at the first request on one without a scheme
    (``127.0.0.1:9000``, a common slip), with a stray space, or empty. The
    value is only ever shown through :func:`redact_endpoint`, and the URL
    parser's own words are never quoted: they may hold a password (its
    ``Port could not be cast to integer value as 'S3cret'``).
    """
    for variable in ENDPOINT_VARIABLES.get(scheme, ()):
        value = os.environ.get(variable)
        if value is None:
            continue
        shown = redact_endpoint(value)
        expected = "expected an http:// or https:// URL with a host, such as http://127.0.0.1:9000"
        # Whenever an "@" is present the likely cause of a parse failure is an unencoded character in a password.
        hint = f" ({_USERINFO_HINT})" if "@" in value else ""
        if not value.strip():
            return f"{variable} is set but empty; {expected} (or unset it)"
        if any(c.isspace() for c in value):
            return f"{variable} {shown!r} holds whitespace (a stray space?); {expected}"
        if "://" not in value or value.split("://", 1)[0].lower() not in ("http", "https"):
            return (f"{variable} {shown!r} has no http:// or https:// scheme; expected an http:// or https:// URL "
                    f"with a host, such as {_endpoint_example(value)}")
        if "\\" in value:  # the store's URL parser reads it as "/", Python's does not: they would disagree on the host
            return f"{variable} {shown!r} holds a '\\', which the store client reads as '/'{hint}; {expected}"
        try:
            parts = urlsplit(value)
        except ValueError:  # a "[" or "]" out of place, or a bracketed host that is no IPv6 address
            return f"{variable} {shown!r} is not a valid URL: its host is not a name or a [IPv6] address{hint}; " \
                   f"{expected}"
        try:
            parts.port  # noqa: B018 (raises ValueError for a port out of range or not a number)
        except ValueError:
            return f"{variable} {shown!r} is not a valid URL: its port is not a number from 0 to 65535{hint}; " \
                   f"{expected}"
        if "@" in parts.path + parts.query + parts.fragment:
            # A "/", "?" or "#" in a password ends the host part early: the store client would connect to the user
            # name as a host and quote the rest of the password in its errors.
            return f"{variable} {shown!r} has an '@' after a '/', '?' or '#'{hint}; {expected}"
        if not parts.hostname:
            return f"{variable} {shown!r} names no host; {expected}"
    return _aliases_disagree(scheme)


# The variables obstore puts into a request's headers, by scheme: a control character in one (the newline a secret
# file mounted from a Kubernetes Secret ends with) made obstore panic at every request, naming the endpoint
# variables, and Rust wrote its panic to stderr each time, a backtrace with RUST_BACKTRACE (the storage hunt).
HEADER_VARIABLES = {
    "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_TOKEN", "AWS_REGION",
           "AWS_DEFAULT_REGION"),
    "az": ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_KEY",
           "AZURE_STORAGE_TOKEN"),
}


def header_value_problem(scheme: str) -> str | None:
    """Which variable obstore would put into a request's headers for ``scheme`` holds a control character (named,
    its value never shown: it may be a secret); None when none does (see HEADER_VARIABLES)."""
    for variable in HEADER_VARIABLES.get(scheme, ()):
        value = os.environ.get(variable)
        if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in value):
            if value.endswith(("\n", "\r")):
                where = "ends with a line break (a secret read from a file keeps its newline)"
            else:
                where = "holds a control character (a tab, a line break)"
            return f"{variable} {where}, which no request header can carry; remove it"
    return None


def boolean_problem(scheme: str) -> str | None:
    """Which boolean variable obstore would read for ``scheme`` holds a value it cannot parse, named with that
    value; None when none does (see BOOLEAN_VARIABLES)."""
    for variable in BOOLEAN_VARIABLES.get(scheme, ()):
        value = os.environ.get(variable)
        if value is not None and value.lower() not in _BOOLEAN_SPELLINGS:
            shown = value if len(value) <= 40 else f"{value[:40]}... ({len(value)} characters)"
            return (f"{variable} {shown!r} is not true or false (the store client reads true, yes, on, y, 1 or "
                    f"false, no, off, n, 0, in any case); set it to true or false, or unset it")
    return None


def _aliases_disagree(scheme: str) -> str | None:
    """Why the endpoint is ambiguous: two spellings of it set to different endpoints (see ENDPOINT_ALIASES)."""
    if scheme == "s3" and "AWS_ENDPOINT_URL_S3" in os.environ:
        return None  # it wins whatever the others say
    names = [name for name in ENDPOINT_ALIASES.get(scheme, ()) if name in os.environ]
    if len(names) == 2 and len({_endpoint_key(os.environ[name]) for name in names}) == 2:
        shown = " and ".join(f"{name} {redact_endpoint(os.environ[name])!r}" for name in names)
        return (f"{shown} are set to different endpoints; the store client reads whichever comes last in the "
                "environment, so which store is reached would depend on their order: set one of them")
    return None


def _endpoint_key(value: str) -> str:
    """An endpoint variable's value as compared: its user part dropped, case and a trailing slash ignored."""
    span = _endpoint_userinfo(value)
    without_user = value if span is None else value[:span[0]] + value[span[1] + 1:]
    return without_user.strip().rstrip("/").lower()


def endpoint_identity(scheme: str) -> str:
    """Which store ``scheme``'s URLs reach: the endpoint variable obstore reads (its user part dropped, case and a
    trailing slash ignored), and Azure's account; "" for the provider's default endpoint.

    Two stores reached at one URL (a MinIO and AWS, both ``s3://models/prod``)
    are two repositories: their mirrors must not share a folder.
    """
    parts = []
    for variable in ENDPOINT_VARIABLES.get(scheme, ()):
        value = os.environ.get(variable)
        if value is not None:  # the first set one is what obstore reads (aliases that disagree are refused)
            parts.append(_endpoint_key(value))
            break
    if scheme == "az":
        parts.append(os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", os.environ.get("AZURE_STORAGE_ACCOUNT", "")))
    return " ".join(part for part in parts if part)


def redact_endpoint(value: str) -> str:
    """An endpoint variable's ``value`` as messages may show it: everything before its last ``@`` after the scheme
    replaced by ``REDACTED``.

    Whatever characters a user name or password holds (a ``/``, ``#``, ``?``
    or ``@`` no URL parser reads as the user's part), nothing of them shows;
    only the scheme (``http:`` with any slashes, another scheme with ``//``)
    and what follows the last ``@`` are kept, which are certainly no secret.
    """
    span = _endpoint_userinfo(value)
    return value if span is None else f"{value[:span[0]]}REDACTED{value[span[1]:]}"


def _endpoint_userinfo(value: str) -> tuple[int, int] | None:
    """Where the user part of an endpoint ``value`` lies (after its scheme, up to its last ``@``); None without one."""
    at = value.rfind("@")
    if at < 0:
        return None
    scheme = _ENDPOINT_SCHEME.match(value)  # it holds no "@": it ends before ``at``
    return (scheme.end() if scheme else 0), at


def _endpoint_example(value: str) -> str:
    """The http:// URL an endpoint ``value`` without one probably meant (its user name and password redacted)."""
    typo = re.match(r"(?i)\s*(https?):/*", value)  # "http:/host" or "http:host": that scheme was meant
    if typo is not None:
        return f"{typo.group(1).lower()}://{redact_endpoint(value[typo.end():])}"
    if "://" in value:  # another scheme ("ftp://...")
        return "http://127.0.0.1:9000"
    return f"http://{redact_endpoint(value.strip())}"


@contextlib.contextmanager
def store_call(scheme: str) -> Iterator[None]:
    """Run obstore calls, turning a panic of its Rust code into a StoreClientPanic (a StorageError).

    pyo3's PanicException derives from BaseException, so an ``except
    Exception`` misses it and it would take the server down; every obstore
    call runs in one of these. (An async call's panic comes as a RustPanic,
    an Exception: turned into the same, so it is not tried again.)
    """
    try:
        yield
    except BaseException as err:
        if type(err).__name__ not in ("PanicException", "RustPanic"):
            raise
        first = (str(err).strip().splitlines() or ["(no message)"])[0]
        variables = ", ".join(ENDPOINT_VARIABLES.get(scheme, ())) or "its endpoint"
        raise StoreClientPanic(cap_message(f"the store client (obstore) failed: {redact(first)[:300]}; check the "
                                           f"store's environment variables ({variables} first)", 600)) from None


def redact(text: str) -> str:
    """``text`` without the secrets a URL in it may carry: ``user:password@`` and signature or token values.

    obstore quotes the request URL in its errors, endpoint included, and these
    messages reach every client (RepositoryIndex reasons). The user part of
    each endpoint variable set now is cut out verbatim too, whatever it holds.
    """
    for secret, host in _endpoint_secrets():
        # The endpoints' own user parts, whatever they hold (a "/" defeats the pattern below), where a URL
        # or a word starts and the endpoint's host follows (a key "models/minio@2/..." is left as it is).
        text = re.sub(rf"(?<![^\s/(\[\"'=,:<]){re.escape(secret)}@(?={re.escape(host)})", "", text)
    return _SECRET_PARAMETER.sub(r"\1REDACTED", _USERINFO.sub(r"\1", text))


def _endpoint_secrets() -> list[tuple[str, str]]:
    """The user parts (``user:password``) of the endpoint variables set now, each with the host that follows
    it, longest first.

    What :func:`redact_endpoint` hides: from after the scheme to the last ``@``.
    """
    secrets: set[tuple[str, str]] = set()
    for variable in {name for names in ENDPOINT_VARIABLES.values() for name in names}:
        value = os.environ.get(variable, "")
        span = _endpoint_userinfo(value)
        if span is not None and span[1] > span[0]:
            host = re.split(r"[/?#]", value[span[1] + 1:], maxsplit=1)[0]
            secrets.add((value[span[0]:span[1]], host))
    return sorted(secrets, key=lambda pair: len(pair[0]), reverse=True)  # a shorter one may be part of a longer


def is_not_found(err: BaseException) -> bool:
    """Whether obstore's ``err`` says the object does not exist (it raises FileNotFoundError or NotFoundError)."""
    return isinstance(err, FileNotFoundError) or type(err).__name__ == "NotFoundError"


def describe_error(err: BaseException, scheme: str = "s3") -> str:
    """obstore's error in one line: the HTTP status and the store's error code, a hint for credentials.

    obstore's messages carry the whole response body and a multi-line debug
    dump; only the first line's facts are kept, without the secrets a URL in
    them may carry (see :func:`redact`).
    """
    if isinstance(err, StorageError):  # described already (a StoreClientPanic)
        return str(err)
    text = redact(str(err).split("\n\nDebug source:", 1)[0].strip())
    status = re.search(r"status code: (\d{3})( [A-Za-z ]+)?", text)
    code = re.search(r"<Code>([^<]{1,80})</Code>", text)
    message = re.search(r"<Message>([^<]{1,300})</Message>", text)
    kind = type(err).__name__
    if status is not None:
        number = int(status.group(1))
        words = f"HTTP {number}{(status.group(2) or '').rstrip()}"
        if code is not None:
            words += f" {code.group(1)}"
        if message is not None:
            words += f": {message.group(1).rstrip('.')}"
        if number in (401, 403) or kind in ("PermissionDeniedError", "UnauthenticatedError"):
            words += f"; the store refused the credentials or their rights: {_CREDENTIAL_HINT.get(scheme, '')}"
        elif number == 412:  # every GET is conditional on the ETag the listing gave
            words += ("; the object changed in the store during the load (an upload in progress?): "
                      "load the model again once it is complete")
        return cap_message(words, 600)
    if kind in ("PermissionDeniedError", "UnauthenticatedError"):
        return cap_message(f"{text.splitlines()[0]}; {_CREDENTIAL_HINT.get(scheme, '')}", 600)
    if "builder error" in text and "http://" in text:
        # The client refuses a plain-http URL before sending anything, and says only "builder error".
        hint = _ALLOW_HTTP_HINT.get(scheme, "allow plain http for the store, or use https")
        return cap_message(f"the store's endpoint is plain http://, which the client refuses "
                           f"({text.splitlines()[0][:300]}); {hint}", 600)
    # The TLS client's reason is only in the debug dump (rustls: InvalidCertificate(UnknownIssuer), ...): the store
    # was reached, its certificate refused; told as unreachable, with an http hint (the storage hunt).
    # (Pretty-printed: "InvalidCertificate(\n    UnknownIssuer,", or nested, "Other(\n OtherError(\n CaUsedAsEndEntity":
    # the innermost name is the reason; the README walkthrough found the one-line pattern never matched.)
    certificate = re.search(r"InvalidCertificate\(\s*((?:\w{1,40}\(\s*){0,3}\w{1,40})", str(err))
    if certificate is not None:
        certificate = re.search(r"(\w{1,40})$", certificate.group(1))
    if certificate is not None and certificate.group(1).startswith(("Expired", "NotValidYet")):  # (...Context)
        return cap_message(f"the store's TLS certificate is out of its validity period ({certificate.group(1)}); "
                           "the store needs a current one (or the clock is wrong)", 600)
    if certificate is not None and certificate.group(1).startswith("NotValidFor"):
        return cap_message(f"the store's TLS certificate is not for the name it was reached by "
                           f"({certificate.group(1)}); check the endpoint's host name "
                           f"({_ENDPOINT_HINT.get(scheme, _ENDPOINT_HINT['s3']).split(',')[0]})", 600)
    if certificate is not None:
        return cap_message(f"the store's TLS certificate is not trusted ({certificate.group(1)}); set SSL_CERT_FILE "
                           f"to the CA that signed it (or {_INVALID_CERTIFICATES.get(scheme, 'the store client')}"
                           "=true, for a test store only)", 600)
    if re.search(r"[Cc]onnection refused|error sending request|dns error|timed out", text):
        return cap_message(f"{_UNREACHABLE} ({text.splitlines()[0][:300]}); check the endpoint "
                           f"({_ENDPOINT_HINT.get(scheme, _ENDPOINT_HINT['s3'])})", 600)
    first = text.splitlines()[0] if text else kind
    return cap_message(f"{kind}: {first}", 600)


@dataclass(frozen=True)
class RangeRead:
    """One ranged GET of ``key`` from byte ``start``, copied in order into ``views`` (consecutive destinations).

    Several views let one GET fill several small tensors that lie next to
    each other in the file: one request instead of many, and still one copy.
    """

    key: str
    start: int
    views: tuple[memoryview, ...]
    what: str  # what the bytes are, for messages (a tensor's name)

    @property
    def length(self) -> int:
        """Bytes this read covers."""
        return sum(len(v) for v in self.views)


def read_ranges(store: Any, location: StoreURL, reads: Sequence[RangeRead], *, concurrency: int, retries: int,
                etags: Mapping[str, str | None] | None = None) -> None:
    """Run ``reads`` with at most ``concurrency`` in flight, each copied straight into its view.

    A read that fails or comes back short is tried again, up to ``retries``
    more times; then StorageError names the object's URL, the byte range, what
    it holds and the cause. With ``etags``, every read is conditional on the
    object still having that ETag, so a file replaced during the load fails it
    rather than mixing two versions.
    """
    if not reads:
        return
    _run(_read_all(store, location, reads, max(1, concurrency), max(0, retries), etags or {}))


async def _read_all(store: Any, location: StoreURL, reads: Sequence[RangeRead], concurrency: int, retries: int,
                    etags: Mapping[str, str | None]) -> None:
    import obstore

    gate = asyncio.Semaphore(concurrency)

    async def one(read: RangeRead) -> None:
        end = read.start + read.length
        options: dict[str, Any] = {"range": (read.start, end)}
        if etags.get(read.key):
            options["if_match"] = etags[read.key]
        cause = ""
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
            async with gate:
                try:
                    with store_call(location.scheme):
                        result = await obstore.get_async(store, read.key, options=options)
                        data = await result.bytes_async()
                except Exception as err:  # any failure of this range: tried again, then reported
                    cause = describe_error(err, location.scheme)
                    if is_not_found(err) or isinstance(err, StoreClientPanic) or type(err).__name__ in (
                            "PreconditionError", "PermissionDeniedError", "UnauthenticatedError"):
                        break  # changed, gone, forbidden or a client failure: another try cannot help
                    continue
            if len(data) != read.length:
                cause = f"the store returned {len(data)} bytes"
                continue
            received, position = memoryview(data).cast("B"), 0
            for view in read.views:
                view[:] = received[position:position + len(view)]
                position += len(view)
            return
        url = f"{location.bucket_url}/{read.key}"
        raise StorageError(f"{url}: bytes {read.start}-{end - 1} ({read.length} bytes of {read.what}): "
                           f"read failed after {attempt + 1} attempt(s): {cause}")

    tasks = [asyncio.ensure_future(one(read)) for read in reads]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _run(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine to completion from synchronous code, on a private loop.

    Loads run on worker threads without a loop; should one be running in
    this thread, the coroutine runs on a thread of its own instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coroutine)
        return
    failure: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(coroutine)
        except BaseException as err:  # handed back to the caller
            failure.append(err)

    thread = threading.Thread(target=target, name="nereid-storage-reads", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
