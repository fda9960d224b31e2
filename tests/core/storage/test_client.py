"""The store client (``nereid.storage.client``): its setup from the environment, its failures told in one line with
the variable to check, its ranged reads, and obstore's panics caught, against a real S3 API on the loopback (moto;
see tests/moto_s3.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from moto_s3 import upload_folder
from nereid.storage import StoreURL


def test_wrong_credentials_give_a_clear_unavailable_reason(s3, serve, tmp_path, monkeypatch, python_folder,
                                                           bucket_config, echo) -> None:
    source = tmp_path / "source"
    python_folder(source, "echo")
    upload_folder(s3.store, source, s3.prefix)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    server = serve(bucket_config(tmp_path, s3.url(), "- name: echo\n"))
    (model,) = server.client.get_model_repository_index().models
    assert model.state == "UNAVAILABLE"
    assert model.reason.startswith(f"{s3.url('echo')}: cannot list the model folder: HTTP 403 Forbidden "
                                   "InvalidAccessKeyId"), model.reason
    assert "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in model.reason
    with pytest.raises(InferenceServerException) as caught:
        echo(server.client, "echo", np.zeros((1, 4), np.float32))
    assert caught.value.status() == "StatusCode.UNAVAILABLE" and "InvalidAccessKeyId" in str(caught.value)
    # Fixed credentials take effect at the next load.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env()["AWS_ACCESS_KEY_ID"])
    server.client.load_model("echo")
    assert server.client.is_model_ready("echo")


def test_an_unreachable_endpoint_names_the_variable_to_check(s3, tmp_path, monkeypatch, capsys, bucket_config) -> None:
    from nereid.cli import main
    from support import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert main(["check", "--config", str(bucket_config(tmp_path, s3.url(), "- name: echo\n"))]) == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(f"echo: UNAVAILABLE: {s3.url('echo')}: cannot list the model folder: cannot reach the "
                           "store ("), line
    assert line.endswith("check the endpoint (AWS_ENDPOINT_URL, and AWS_ALLOW_HTTP for http://)")


def test_a_plain_http_endpoint_without_allow_http_says_to_set_it(s3, tmp_path, monkeypatch, capsys,
                                                                 bucket_config) -> None:
    from nereid.cli import main

    monkeypatch.delenv("AWS_ALLOW_HTTP")  # the endpoint is moto's http://127.0.0.1:<port>
    assert main(["check", "--config", str(bucket_config(tmp_path, s3.url(), "- name: echo\n"))]) == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(f"echo: UNAVAILABLE: {s3.url('echo')}: cannot list the model folder: the store's "
                           "endpoint is plain http://, which the client refuses ("), line
    assert line.endswith("set AWS_ALLOW_HTTP=true for a plain-http endpoint (AWS_ENDPOINT_URL=http://...)"), line


@pytest.mark.parametrize("endpoint, problem", [
    ("127.0.0.1:{port}", "AWS_ENDPOINT_URL '127.0.0.1:{port}' has no http:// or https:// scheme; expected an http:// "
                         "or https:// URL with a host, such as http://127.0.0.1:{port}"),
    ("http://127.0.0.1:{port} ", "AWS_ENDPOINT_URL 'http://127.0.0.1:{port} ' holds whitespace (a stray space?); "
                                 "expected an http:// or https:// URL with a host, such as http://127.0.0.1:9000"),
], ids=["no scheme", "a stray space"])
def test_a_malformed_endpoint_is_named_instead_of_crashing_the_check(s3, tmp_path, monkeypatch, capsys, endpoint,
                                                                     problem, bucket_config) -> None:
    # obstore panics at the first request on such an endpoint (a PanicException, which is no Exception).
    from nereid.cli import main

    port = s3.endpoint.rsplit(":", 1)[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.format(port=port))
    assert main(["check", "--config", str(bucket_config(tmp_path, s3.url(), "- name: echo\n"))]) == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert line == f"echo: UNAVAILABLE: {s3.url()}: cannot set up the store: {problem.format(port=port)}"


@pytest.mark.parametrize("variable, value", [("AWS_ALLOW_HTTP", ""), ("AWS_ALLOW_HTTP", "maybe"),
                                             ("AWS_SKIP_SIGNATURE", "T"), ("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", " ")],
                         ids=["empty", "maybe", "T", "a space"])
def test_a_boolean_variable_the_store_client_cannot_read_is_named_with_its_value(s3, tmp_path, monkeypatch, capsys,
                                                                               variable, value, bucket_config) -> None:
    """Defect (found by a bug hunt): obstore refuses such a value naming only the value ('failed to parse "" as
    boolean'); an empty AWS_ALLOW_HTTP (Helm's `value: ""`) failed every load without saying which variable."""
    from nereid.cli import main

    monkeypatch.setenv(variable, value)
    assert main(["check", "--config", str(bucket_config(tmp_path, s3.url(), "- name: echo\n"))]) == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert line == (f"echo: UNAVAILABLE: {s3.url()}: cannot set up the store: {variable} {value!r} is not true or "
                    "false (the store client reads true, yes, on, y, 1 or false, no, off, n, 0, in any case); set it "
                    "to true or false, or unset it"), line
    monkeypatch.setenv(variable, "Yes" if variable != "AWS_ALLOW_HTTP" else "TRUE")  # any case of its spellings
    config = bucket_config(tmp_path, s3.url(), "- name: echo\n")
    assert main(["check", "--config", str(config)]) == 1  # (no such folder)
    out = capsys.readouterr().out
    assert variable not in out and "cannot set up the store" not in out and out.startswith("echo: UNAVAILABLE: "), out


@pytest.mark.parametrize("variable", ["AWS_SESSION_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_TOKEN"])
def test_a_header_variable_ending_in_a_newline_is_named_without_its_value(s3, tmp_path, monkeypatch, capsys,
                                                                          variable, bucket_config) -> None:
    """Found by the storage hunt: a credential read from a secret file keeps its newline, and obstore panicked at
    every request (a Rust panic on stderr each time), its reason naming the endpoint variables."""
    from nereid.cli import main

    secret = "s3cr3t-value"
    monkeypatch.setenv(variable, secret + "\n")
    assert main(["check", "--config", str(bucket_config(tmp_path, s3.url(), "- name: echo\n"))]) == 1
    captured = capsys.readouterr()
    line = captured.out.splitlines()[0]
    assert line == (f"echo: UNAVAILABLE: {s3.url()}: cannot set up the store: {variable} ends with a line break (a "
                    "secret read from a file keeps its newline), which no request header can carry; remove it"), line
    assert secret not in captured.out + captured.err and "panicked" not in captured.err


def test_a_store_client_panic_leaves_the_server_up_with_the_reason(s3, serve, tmp_path, monkeypatch, python_folder,
                                                                   bucket_config) -> None:
    from moto_s3 import BUCKET
    from nereid.storage import RangeRead, StorageError, open_store, read_ranges

    source = tmp_path / "source"
    python_folder(source, "echo")
    upload_folder(s3.store, source, s3.prefix)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:1")
    server = serve(bucket_config(tmp_path, s3.url(), "- name: echo\n"))  # it starts
    (model,) = server.client.get_model_repository_index().models
    assert (model.name, model.state) == ("echo", "UNAVAILABLE")
    assert model.reason == (f"{s3.url()}: cannot set up the store: AWS_ENDPOINT_URL '127.0.0.1:1' has no http:// or "
                            "https:// scheme; expected an http:// or https:// URL with a host, such as "
                            "http://127.0.0.1:1")
    # A host with a character the HTTP client refuses passes the check, and obstore panics on it: caught too.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://a|b:1")
    with pytest.raises(InferenceServerException):
        server.client.load_model("echo")
    (model,) = server.client.get_model_repository_index().models
    assert model.state == "UNAVAILABLE"
    assert model.reason.startswith(f"{s3.url('echo')}: cannot list the model folder: the store client (obstore) "
                                   "failed: request valid: InvalidUri("), model.reason
    assert model.reason.endswith("check the store's environment variables (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, "
                                 "AWS_ENDPOINT first)")
    location = StoreURL("s3", BUCKET, s3.prefix)
    with pytest.raises(StorageError, match=r"read failed after 1 attempt\(s\): the store client \(obstore\) failed"):
        read_ranges(open_store(location, max_retries=0), location,
                    [RangeRead(f"{s3.prefix}/echo/main.py", 0, (memoryview(bytearray(4)),), "a test range")],
                    concurrency=1, retries=3)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)  # fixed: the next load sets the store up anew
    server.client.load_model("echo")
    assert server.client.is_model_ready("echo")


def test_a_weights_object_gone_from_the_bucket_is_not_read_again(s3) -> None:
    # obstore raises FileNotFoundError for a 404: another try cannot help.
    from moto_s3 import BUCKET
    from nereid.storage import RangeRead, StorageError, open_store, read_ranges

    location = StoreURL("s3", BUCKET, s3.prefix)
    read = RangeRead(f"{s3.prefix}/m/weights.safetensors", 0, (memoryview(bytearray(8)),), "the safetensors header")
    with pytest.raises(StorageError, match=r"m/weights.safetensors: bytes 0-7 \(8 bytes of the safetensors header\): "
                                           r"read failed after 1 attempt\(s\)"):
        read_ranges(open_store(location, max_retries=0), location, [read], concurrency=1, retries=3)
    assert len(s3.gets("m/weights.safetensors")) == 1


def test_a_store_failures_kind_drops_its_timings_and_counts_but_keeps_its_status_and_names() -> None:
    """Retries that fail as the last one did are said once (see the watcher): the kind tells them apart. It used
    to drop every digit, so a 503 after a 500, or a read of model.b32 after model.b8, read as the same."""
    from nereid.storage import failure_kind

    assert failure_kind("s3://b/m/x: HTTP 500 in 12.5ms, after 3 retries") == \
        failure_kind("s3://b/m/x: HTTP 500 in 7.25ms, after 4 retries") == \
        "s3://b/m/x: HTTP 500 in #ms, after # retries"
    assert failure_kind("s3://b/m/x: HTTP 500") != failure_kind("s3://b/m/x: HTTP 503")
    assert failure_kind("m/model.b8: read failed after 4 attempt(s)") != \
        failure_kind("m/model.b32: read failed after 2 attempt(s)")


def test_a_store_whose_certificate_is_refused_is_told_so_and_each_scheme_its_own_variables() -> None:
    """Found by the storage hunt: an https store with a certificate no CA vouches for (or expired) was "cannot reach
    the store ... (AWS_ENDPOINT_URL, and AWS_ALLOW_HTTP for http://)": the reason was only in obstore's debug dump;
    and gs:// and az:// stores were told of the AWS variables."""
    from nereid.storage import describe_error, store_unreachable
    from nereid.storage.client import StorageError

    class GenericError(Exception):
        pass

    refused = GenericError("Generic S3 error: Error performing list request: error sending request\n\nDebug source:\n"
                           "Generic { source: hyper_util::client::legacy::Error(Connect, Custom { kind: Other, error: "
                           "InvalidCertificate(UnknownIssuer) }) }")
    said = describe_error(refused, "s3")
    assert said == ("the store's TLS certificate is not trusted (UnknownIssuer); set SSL_CERT_FILE to the CA that "
                    "signed it (or AWS_ALLOW_INVALID_CERTIFICATES=true, for a test store only)"), said
    assert not store_unreachable(StorageError(said))
    wrong_name = GenericError("error sending request\n\nDebug source:\nInvalidCertificate(NotValidForName)")
    assert describe_error(wrong_name, "s3") == ("the store's TLS certificate is not for the name it was reached by "
                                                "(NotValidForName); check the endpoint's host name (AWS_ENDPOINT_URL)")
    unreachable = GenericError("Generic error: error sending request for url (http://127.0.0.1:1/b)")
    assert describe_error(unreachable, "gs").endswith("check the endpoint (GOOGLE_BASE_URL, and GOOGLE_ALLOW_HTTP "
                                                      "for http://)")
    assert describe_error(unreachable, "az").endswith("check the endpoint (AZURE_STORAGE_ENDPOINT, and "
                                                      "AZURE_ALLOW_HTTP for http://)")


def test_a_failure_is_the_store_s_when_a_storage_error_caused_it_or_was_being_handled() -> None:
    """What the watcher and the repository tell a store's outage (tried again) from a model's own fault by."""
    from nereid.errors import ConfigError
    from nereid.storage.client import StorageError, store_failed

    def raised(make):
        try:
            make()
        except BaseException as err:  # (what the caller would have caught)
            return err
        raise AssertionError("nothing raised")

    def wrapped() -> None:  # a backend wrapping its weights stream's failure
        try:
            raise StorageError("s3://b/m/w.bin: HTTP 503")
        except StorageError as err:
            raise ConfigError("model 'm': cannot read the weights") from err

    def during() -> None:  # raised while handling one, without saying from what
        try:
            raise StorageError("s3://b/m: cannot list the model folder")
        except StorageError:
            raise ValueError("a cleanup failed too")

    def unrelated() -> None:  # raised while handling one, but said not to come from it
        try:
            raise StorageError("s3://b/m: HTTP 500")
        except StorageError:
            raise ConfigError("model 'm': main.py is missing") from None

    assert store_failed(StorageError("s3://b/m: HTTP 500"))
    assert store_failed(raised(wrapped)) and store_failed(raised(during))
    assert not store_failed(raised(unrelated)) and not store_failed(ConfigError("model 'm': main.py is missing"))
    looped = ValueError("a cycle of causes")
    looped.__cause__ = ValueError("its cause")
    looped.__cause__.__cause__ = looped
    assert not store_failed(looped)  # (ends)


def test_a_panic_of_the_store_client_is_a_storage_error_naming_the_variables_to_check() -> None:
    """pyo3's PanicException derives from BaseException: uncaught, it would end the server."""
    from nereid.storage.client import StoreClientPanic, store_call

    class PanicException(BaseException):  # (obstore's, by its name: pyo3 makes the class at run time)
        pass

    with pytest.raises(StoreClientPanic) as caught:
        with store_call("gs"):
            raise PanicException("called `Option::unwrap()` on a `None` value\nat src/client.rs:12")
    assert str(caught.value) == ("the store client (obstore) failed: called `Option::unwrap()` on a `None` value; "
                                 "check the store's environment variables (GOOGLE_BASE_URL first)")
    with pytest.raises(KeyboardInterrupt):  # any other BaseException goes its way
        with store_call("s3"):
            raise KeyboardInterrupt


def test_a_store_s_error_is_told_in_one_line_by_its_status_code_and_message() -> None:
    from nereid.storage.client import describe_error

    class GenericError(Exception):
        pass

    denied = GenericError("Error performing GET http://127.0.0.1:9000/b/k in 3ms - Server returned non-success "
                          "status code: 403 Forbidden: <Error><Code>AccessDenied</Code><Message>Access Denied."
                          "</Message></Error>\n\nDebug source:\nGeneric { ... }")
    assert describe_error(denied, "s3") == (
        "HTTP 403 Forbidden AccessDenied: Access Denied; the store refused the credentials or their rights: check "
        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL, AWS_REGION)")
    changed = GenericError("Error performing GET: status code: 412 Precondition Failed: <Code>PreconditionFailed"
                           "</Code>")
    assert describe_error(changed, "gs") == (
        "HTTP 412 Precondition Failed PreconditionFailed; the object changed in the store during the load (an upload "
        "in progress?): load the model again once it is complete")
    assert describe_error(GenericError("something new\nits details"), "s3") == "GenericError: something new"


def test_an_object_is_not_found_by_either_of_the_store_client_s_errors() -> None:
    from nereid.storage.client import is_not_found

    class NotFoundError(Exception):  # (obstore's, by its name)
        pass

    assert is_not_found(FileNotFoundError("m/w.bin")) and is_not_found(NotFoundError("m/w.bin"))
    assert not is_not_found(PermissionError("m/w.bin")) and not is_not_found(KeyError("m/w.bin"))


def test_an_endpoint_shown_in_a_message_keeps_only_its_scheme_and_what_follows_its_last_at_sign() -> None:
    from nereid.storage.client import redact_endpoint

    assert redact_endpoint("http://minio:pw@127.0.0.1:9000") == "http://REDACTED@127.0.0.1:9000"
    assert redact_endpoint("https://op:a/b@c#d@store.example") == "https://REDACTED@store.example"  # (the last '@')
    assert redact_endpoint("op:pw@127.0.0.1:9000") == "REDACTED@127.0.0.1:9000"  # (no scheme: all before the '@')
    assert redact_endpoint("http://127.0.0.1:9000") == "http://127.0.0.1:9000"


def test_which_store_a_scheme_reaches_is_the_endpoint_read_without_its_user_case_or_last_slash(monkeypatch) -> None:
    """What names a bucket's mirror beside its URL (see test_mirror.py: one URL on two stores)."""
    from nereid.storage.client import ENDPOINT_VARIABLES, endpoint_identity

    for variable in {name for names in ENDPOINT_VARIABLES.values() for name in names}:
        monkeypatch.delenv(variable, raising=False)
    for variable in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT"):
        monkeypatch.delenv(variable, raising=False)
    assert endpoint_identity("s3") == endpoint_identity("gs") == endpoint_identity("az") == ""  # the provider's
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://op:pw@MinIO:9000/")
    assert endpoint_identity("s3") == "http://minio:9000"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://other:9000")  # read first, as obstore does
    assert endpoint_identity("s3") == "http://other:9000"
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    assert endpoint_identity("az") == "acct"
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", "http://azurite:10000")
    assert endpoint_identity("az") == "http://azurite:10000 acct"


def test_a_control_character_inside_a_header_variable_is_named_without_its_value(monkeypatch) -> None:
    from nereid.storage.client import HEADER_VARIABLES, header_value_problem

    for variable in HEADER_VARIABLES["s3"]:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t\tvalue")
    problem = header_value_problem("s3")
    assert problem == ("AWS_SECRET_ACCESS_KEY holds a control character (a tab, a line break), which no request "
                       "header can carry; remove it")
    assert header_value_problem("gs") is None  # (no variable of its headers is checked)
