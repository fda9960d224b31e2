"""A user name and password in a store's endpoint variable never reach a reason, an error text or the log.

Whatever the endpoint holds: a '#', '?', '/' or '\\' in the password (which ends the host part early, so
no URL parser reads it as a password), a 'http:/' slip, no scheme at all. The message still says what is
wrong, showing the endpoint with everything between its scheme and its last '@' as REDACTED.
"""

from __future__ import annotations

import logging
import textwrap

import pytest
from tritonclient.utils import InferenceServerException

from moto_s3 import upload_folder
from nereid.settings import load_settings
from support import ECHO_MAIN, free_port, textproto_single

USER, PASSWORD = "opUSER", "S3cret"
_FIX = ("a '/', '?', '#', '@' or '\\' in a user name or password must be percent-encoded as %2F, %3F, %23, %40, "
        "%5C")
_EXPECTED = "expected an http:// or https:// URL with a host, such as http://127.0.0.1:9000"

# (variable, its value, the problem the reason names); {port} is a port nothing listens on.
MALFORMED = [
    ("AWS_ENDPOINT_URL", "http://opUSER:S3cret#pw@127.0.0.1:{port}",
     f"AWS_ENDPOINT_URL 'http://REDACTED@127.0.0.1:{{port}}' is not a valid URL: its port is not a number from 0 "
     f"to 65535 ({_FIX}); {_EXPECTED}"),
    ("AWS_ENDPOINT_URL", "http://opUSER:S3cret?pw@127.0.0.1:{port}",
     "AWS_ENDPOINT_URL 'http://REDACTED@127.0.0.1:{port}' is not a valid URL: its port is not a number"),
    ("AWS_ENDPOINT_URL", "http://opUSER:S3cret/pw@127.0.0.1:{port}",
     "AWS_ENDPOINT_URL 'http://REDACTED@127.0.0.1:{port}' is not a valid URL: its port is not a number"),
    ("AWS_ENDPOINT_URL", "http:/opUSER:S3cretpw@127.0.0.1:{port}",
     "AWS_ENDPOINT_URL 'http:/REDACTED@127.0.0.1:{port}' has no http:// or https:// scheme; expected an http:// "
     "or https:// URL with a host, such as http://REDACTED@127.0.0.1:{port}"),
    ("AWS_ENDPOINT_URL", "http:opUSER:S3cret@127.0.0.1:{port}",
     "AWS_ENDPOINT_URL 'http:REDACTED@127.0.0.1:{port}' has no http:// or https:// scheme; expected an http:// "
     "or https:// URL with a host, such as http://REDACTED@127.0.0.1:{port}"),
    ("AWS_ENDPOINT_URL", "opUSER:S3cret@127.0.0.1:{port}",
     "AWS_ENDPOINT_URL 'REDACTED@127.0.0.1:{port}' has no http:// or https:// scheme; expected an http:// "
     "or https:// URL with a host, such as http://REDACTED@127.0.0.1:{port}"),
    ("AWS_ENDPOINT_URL", "ftp://opUSER:S3cret/x@127.0.0.1:{port}",
     "AWS_ENDPOINT_URL 'ftp://REDACTED@127.0.0.1:{port}' has no http:// or https:// scheme; expected an http:// "
     "or https:// URL with a host, such as http://127.0.0.1:9000"),
    # A password that reads as a port: urlsplit and the store client would take the user name for the host.
    ("AWS_ENDPOINT_URL", "http://opUSER:1234/S3cret@127.0.0.1:{port}",
     f"AWS_ENDPOINT_URL 'http://REDACTED@127.0.0.1:{{port}}' has an '@' after a '/', '?' or '#' ({_FIX}); "
     f"{_EXPECTED}"),
    ("AWS_ENDPOINT_URL", "http://opUSER:S3cret\\pw@127.0.0.1:{port}",
     f"AWS_ENDPOINT_URL 'http://REDACTED@127.0.0.1:{{port}}' holds a '\\', which the store client reads as '/' "
     f"({_FIX}); {_EXPECTED}"),
    ("AWS_ENDPOINT_URL", "http://opUSER:S3cret pw@127.0.0.1:{port}",
     f"AWS_ENDPOINT_URL 'http://REDACTED@127.0.0.1:{{port}}' holds whitespace (a stray space?); {_EXPECTED}"),
    ("AWS_ENDPOINT_URL", "https://opUSER:S3cret@", f"AWS_ENDPOINT_URL 'https://REDACTED@' names no host; {_EXPECTED}"),
    ("AWS_ENDPOINT_URL", "http://opUSER:S3cret@[::1:{port}",
     "AWS_ENDPOINT_URL 'http://REDACTED@[::1:{port}' is not a valid URL: its host is not a name or a [IPv6] "
     "address"),
    ("AWS_ENDPOINT_URL_S3", "http://opUSER:S3cret#pw@127.0.0.1:{port}",
     "AWS_ENDPOINT_URL_S3 'http://REDACTED@127.0.0.1:{port}' is not a valid URL"),
    ("AWS_ENDPOINT", "http://opUSER:S3cret/pw@127.0.0.1:{port}",
     "AWS_ENDPOINT 'http://REDACTED@127.0.0.1:{port}' is not a valid URL"),
]
IDS = ["#", "?", "/", "one slash", "no slash", "no scheme", "ftp", "numeric password and /", "backslash", "space",
       "no host", "[", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"]
REACHABLE = [
    # Valid URLs (an unencoded '@' or a ';' in the password): the store client tries them and quotes the URL
    # in its error, which is redacted.
    ("AWS_ENDPOINT_URL", "http://opUSER:p@S3cret@127.0.0.1:{port}", "cannot reach the store (Generic S3 error"),
    ("AWS_ENDPOINT_URL", "http://opUSER:S3cret;x@127.0.0.1:{port}", "cannot reach the store (Generic S3 error"),
]


def _assert_no_secret(text: str) -> None:
    assert USER not in text and PASSWORD not in text, text


@pytest.mark.parametrize("variable, value, problem", MALFORMED, ids=IDS)
def test_no_endpoint_shows_its_password_in_an_error_the_log_or_check(s3, tmp_path, monkeypatch, caplog, capsys,
                                                                     variable, value, problem, bucket_config) -> None:
    from nereid.cli import main
    from nereid.storage import StorageError, list_model_folders, scan_model_folders

    port = free_port()  # nothing listens there
    monkeypatch.setenv(variable, value.format(port=port))
    config = bucket_config(tmp_path, s3.url(), "- name: echo\n")
    with pytest.raises(StorageError) as caught:
        scan_model_folders(load_settings(config).server)
    _assert_no_secret(str(caught.value))
    assert problem.format(port=port) in str(caught.value)
    with caplog.at_level(logging.DEBUG):
        assert list_model_folders(load_settings(config).server) == []  # the failure is logged
    assert problem.format(port=port) in caplog.text
    for record in caplog.records:
        _assert_no_secret(record.getMessage())
    assert main(["check", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    _assert_no_secret(out)
    assert out.startswith(f"echo: UNAVAILABLE: {s3.url()}") and problem.format(port=port) in out, out


def test_no_endpoint_shows_its_password_to_a_client(s3, serve, tmp_path, monkeypatch, caplog, bucket_config) -> None:
    # Over the wire: the load's error and the RepositoryIndex reason, one server for every hostile value (those
    # the store client tries are only tried here: each failed listing takes its retries).
    source = tmp_path / "source" / "echo"
    source.mkdir(parents=True)
    (source / "model_inference.textproto").write_text(textproto_single())
    (source / "main.py").write_text(textwrap.dedent(ECHO_MAIN))
    upload_folder(s3.store, source.parent, s3.prefix)
    server = serve(bucket_config(tmp_path, s3.url(), "- name: echo\n"))
    assert server.client.is_model_ready("echo")
    port = free_port()
    with caplog.at_level(logging.DEBUG):
        for variable, value, problem in MALFORMED + REACHABLE:
            with monkeypatch.context() as patch:
                patch.setenv(variable, value.format(port=port))
                with pytest.raises(InferenceServerException) as caught:
                    server.client.load_model("echo")
            _assert_no_secret(str(caught.value))
            (model,) = server.client.get_model_repository_index().models
            assert problem.format(port=port) in model.reason, model.reason  # (the running version keeps serving)
            _assert_no_secret(model.reason)
    server.client.load_model("echo")  # the endpoint fixed: it loads again
    assert server.client.is_model_ready("echo")
    for record in caplog.records:
        _assert_no_secret(record.getMessage())


def test_the_store_clients_words_lose_an_endpoint_password_holding_a_slash(monkeypatch) -> None:
    # Should such an endpoint ever reach the store client, its errors quote it with the password cut at the '/'.
    from nereid.storage.client import endpoint_problem, redact

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://opUSER:12/S3cret@127.0.0.1:1")
    assert redact("Error performing GET http://opUSER:12/S3cret@127.0.0.1:1/b?list-type=2 in 1ms - error") == \
        "Error performing GET http://127.0.0.1:1/b?list-type=2 in 1ms - error"
    # Only where the endpoint's host follows: a key or a word holding the same text before an "@" is left whole.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio@127.0.0.1:9000")
    assert redact("GET s3://bucket/models/minio@2/main.py (email: minio@corp.example)") == \
        "GET s3://bucket/models/minio@2/main.py (email: minio@corp.example)"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://opUSER:12/S3cret@127.0.0.1:1")
    # The well-formed case, without the endpoint being set, is redacted as before.
    assert redact("GET http://minio:pw@127.0.0.1:9000/b failed") == "GET http://127.0.0.1:9000/b failed"
    # Every store's endpoint variables are checked alike.
    monkeypatch.setenv("GOOGLE_BASE_URL", "https://opUSER:S3cret#x@storage.example.com")
    problem = endpoint_problem("gs")
    assert problem is not None and problem.startswith(
        "GOOGLE_BASE_URL 'https://REDACTED@storage.example.com' is not a valid URL: its port is not a number")
    _assert_no_secret(problem)


def test_two_spellings_of_the_endpoint_set_to_different_stores_are_refused(monkeypatch) -> None:
    """Defect (found by a bug hunt, reproduced against two moto servers): obstore reads AWS_ENDPOINT_URL and
    AWS_ENDPOINT as one setting, whichever comes last in the environment, while the mirror was named after
    AWS_ENDPOINT_URL: with both set, differently, a server could read one store into another store's mirror."""
    from nereid.storage.client import endpoint_problem

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://op:S3cret@127.0.0.1:9000")
    monkeypatch.setenv("AWS_ENDPOINT", "http://127.0.0.1:9001")
    problem = endpoint_problem("s3")
    assert problem == ("AWS_ENDPOINT_URL 'http://REDACTED@127.0.0.1:9000' and AWS_ENDPOINT 'http://127.0.0.1:9001' "
                       "are set to different endpoints; the store client reads whichever comes last in the "
                       "environment, so which store is reached would depend on their order: set one of them")
    monkeypatch.setenv("AWS_ENDPOINT", "HTTP://127.0.0.1:9000/")  # the same endpoint, spelled otherwise: fine
    assert endpoint_problem("s3") is None
    monkeypatch.setenv("AWS_ENDPOINT", "http://127.0.0.1:9001")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9002")  # wins over both, as the AWS SDKs have it
    assert endpoint_problem("s3") is None
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", "http://127.0.0.1:10000")
    monkeypatch.setenv("AZURE_ENDPOINT", "http://127.0.0.1:10001")
    assert "AZURE_STORAGE_ENDPOINT 'http://127.0.0.1:10000' and AZURE_ENDPOINT" in endpoint_problem("az")


def test_a_password_in_the_endpoint_never_reaches_a_reason(s3, serve, tmp_path, monkeypatch, bucket_config) -> None:
    import socket

    from nereid.storage.client import redact

    # Bound but never listening: connections are refused (obstore's error quotes the request URL), and no other
    # test's server can take the port meanwhile, as one could a port found free and let go.
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://minio:pwLEAK@127.0.0.1:{port}")
    with holder:
        server = serve(bucket_config(tmp_path, s3.url(), "- name: echo\n"))
        (model,) = server.client.get_model_repository_index().models
    assert model.state == "UNAVAILABLE" and f"http://127.0.0.1:{port}/" in model.reason, model.reason
    assert "pwLEAK" not in model.reason and "minio:" not in model.reason
    # Should obstore ever quote a presigned URL, its signature and credential are not shown either.
    assert redact("GET https://s3.example.com/b/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=f00&x=1 failed") == \
        "GET https://s3.example.com/b/k?X-Amz-Credential=REDACTED&X-Amz-Signature=REDACTED&x=1 failed"
