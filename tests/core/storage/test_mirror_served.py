"""Model repositories in object storage, end to end: a real server (and ``nereid check``) on a bucket of a real S3
API on the loopback (moto; see tests/moto_s3.py), through ``nereid.storage``'s mirror.

The python model here is served from ``s3://``: its folder is materialized
into the cache folder, refreshed by ETag, and nothing is written to the bucket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import obstore
import pytest
from tritonclient.utils import InferenceServerException

from moto_s3 import bucket_state, iter_files, upload_folder
from nereid.settings import load_settings
from nereid.storage.mirror import MARKER_FILE, read_marker
from support import ECHO_MAIN, expect_grpc_error


DOUBLE_MAIN = ECHO_MAIN.replace("out.write(data)", "import array; a = array.array('f', data); "
                                                   "out.write(array.array('f', [2 * v for v in a]).tobytes())")


def test_a_python_model_is_served_from_s3_and_refreshed_by_etag(s3, serve, tmp_path, python_folder, bucket_config,
                                                                echo) -> None:
    source = tmp_path / "source"
    python_folder(source, "echo")
    python_folder(source, ".hidden")  # hidden folders are skipped, as locally
    upload_folder(s3.store, source, s3.prefix)
    before = bucket_state(s3.store, s3.prefix)
    server = serve(bucket_config(tmp_path, s3.url()))
    index = {m.name: m.state for m in server.client.get_model_repository_index().models}
    assert index == {"echo": "READY"}
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(echo(server.client, "echo", x), x)
    folder = server.server.settings.server.ml_backends_path / "echo"
    assert folder.is_relative_to(tmp_path / "cache")
    assert (folder / "helpers" / "note.txt").read_text() == "a helper file in a sub-folder"
    fetched = read_marker(folder).fetched
    assert set(fetched) == {"main.py", "model_inference.textproto", "helpers/note.txt"}
    # A new main.py in the bucket (a new ETag) is fetched at the next load; unchanged files are not.
    gets_before = len(s3.gets("/echo/model_inference.textproto"))
    assert gets_before == 1  # fetched once, at the first load
    obstore.put(s3.store, f"{s3.prefix}/echo/main.py", textwrap.dedent(DOUBLE_MAIN).encode())
    server.client.load_model("echo")
    np.testing.assert_array_equal(echo(server.client, "echo", x), 2 * x)
    assert len(s3.gets("/echo/model_inference.textproto")) == gets_before
    assert read_marker(folder).fetched["main.py"].etag != fetched["main.py"].etag
    # A file removed from the bucket is removed from the cache at the next load.
    obstore.delete(s3.store, f"{s3.prefix}/echo/helpers/note.txt")
    server.client.load_model("echo")
    assert not (folder / "helpers").exists() and (folder / MARKER_FILE).is_file()
    # Nothing was ever written into the bucket by the server.
    after = bucket_state(s3.store, s3.prefix)
    del before[f"{s3.prefix}/echo/main.py"], before[f"{s3.prefix}/echo/helpers/note.txt"]
    assert {k: v for k, v in after.items() if not k.endswith("/echo/main.py")} == before


def test_a_model_uploaded_late_loads_at_once_and_one_deleted_leaves_once_unloaded(s3, serve, tmp_path, python_folder,
                                                                                  bucket_config, echo) -> None:
    source = tmp_path / "source"
    python_folder(source, "echo")
    upload_folder(s3.store, source, s3.prefix)
    server = serve(bucket_config(tmp_path, s3.url()))
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    with pytest.raises(InferenceServerException, match="unknown model 'late'"):
        echo(server.client, "late", x)  # the server has just listed the bucket, without 'late'
    python_folder(source, "late")
    upload_folder(s3.store, source / "late", f"{s3.prefix}/late")
    server.client.load_model("late")  # at once: the load looks at the bucket again
    np.testing.assert_array_equal(echo(server.client, "late", x), x)
    # Deleted from the bucket, a loaded model serves until it is unloaded; then it leaves the index.
    for key in bucket_state(s3.store, f"{s3.prefix}/echo/"):
        obstore.delete(s3.store, key)
    index = {m.name: m.state for m in server.client.get_model_repository_index().models}
    assert index == {"echo": "READY", "late": "READY"}
    np.testing.assert_array_equal(echo(server.client, "echo", x), x)
    server.client.unload_model("echo")
    assert [m.name for m in server.client.get_model_repository_index().models] == ["late"]


def test_a_load_of_a_model_whose_prefix_is_gone_is_not_found_as_for_a_local_folder(s3, serve, tmp_path, monkeypatch,
                                                                                   python_folder,
                                                                                   bucket_config) -> None:
    """Defect (found by a bug hunt): RepositoryModelLoad of a loaded model whose prefix was deleted, or of a listed
    model with no prefix, answered INTERNAL "failed to load model ...: no such model folder (no objects under it)",
    where a local folder (and the README's Errors table) answer NOT_FOUND; INTERNAL says the model is broken."""
    from support import expect_grpc_error

    source = tmp_path / "source"
    python_folder(source, "m")
    python_folder(source, "unlisted")
    upload_folder(s3.store, source, s3.prefix)
    server = serve(bucket_config(tmp_path, s3.url(), "- name: m\n- name: listed_missing\n"))
    assert server.client.is_model_ready("m")
    for key in bucket_state(s3.store, f"{s3.prefix}/"):
        obstore.delete(s3.store, key)
    expect_grpc_error("NOT_FOUND", lambda: server.client.load_model("unlisted"),
                      "unknown model 'unlisted' (no folder 'unlisted' under ml_backends_path)")
    # A name no key can hold (the store client refuses control characters): no folder, not the store's failure
    # (it was UNAVAILABLE 'cannot list the model folders: ... Could not parse path'; the path-safety hunt).
    for odd in ("x\ty", "ghost\x01", "a\x7fb"):
        expect_grpc_error("NOT_FOUND", lambda: server.client.load_model(odd), "unknown model ")
    expect_grpc_error("NOT_FOUND", lambda: server.client.load_model("m"),
                      "model 'm': its folder 'm' is gone from ml_backends_path, so it cannot be loaded again; the "
                      "version loaded before serves on (nothing follows the folder without server.watch)")
    assert server.client.is_model_ready("m")  # (it serves on)
    expect_grpc_error("NOT_FOUND", lambda: server.client.load_model("listed_missing"),
                      "model 'listed_missing': its folder 'listed_missing' is missing from ml_backends_path, so it "
                      "cannot be loaded; nereid.yaml lists it: put its folder back, then load it again")
    server.client.unload_model("m")
    expect_grpc_error("NOT_FOUND", lambda: server.client.load_model("m"), "model 'm': its folder 'm' is missing")
    # NOT_FOUND only when the store answered that it holds nothing: one that cannot be listed cannot tell (and
    # a load it fails is UNAVAILABLE, the store's fault, not the model's).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    expect_grpc_error("UNAVAILABLE", lambda: server.client.load_model("m"), "HTTP 403 Forbidden InvalidAccessKeyId")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env()["AWS_ACCESS_KEY_ID"])
    upload_folder(s3.store, source, s3.prefix)
    server.client.load_model("m")
    assert server.client.is_model_ready("m")


def test_a_bucket_that_cannot_be_listed_at_start_keeps_the_server_not_ready_until_its_folders_load(
        s3, serve, tmp_path, monkeypatch, caplog, python_folder, bucket_config, echo, until) -> None:
    """Defect (found by a bug hunt): with no models: key and no watch, a server started while its bucket could not be
    listed (an outage of a few seconds, wrong credentials) was ready serving nothing, for good: the folders found
    later were UNAVAILABLE "not listed in nereid.yaml", which lists nothing."""
    import nereid.store_retries

    monkeypatch.setattr(nereid.store_retries, "STARTUP_LISTING_FIRST_S", 0.1, raising=False)
    source = tmp_path / "source"
    python_folder(source, "echo")
    upload_folder(s3.store, source, s3.prefix)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    with caplog.at_level(logging.DEBUG, logger="nereid.repository"):
        server = serve(bucket_config(tmp_path, s3.url()))
        assert not server.client.is_server_ready()  # a readiness probe must not route to it
        assert (f"{s3.url()}: the server is not ready until its model folders can be listed: listing them again in "
                "0.1 s, then less often (at most every 30 s); every folder found then loads, as at start"
                in caplog.text)
        until(lambda: "the server is still not ready (its model folders cannot be listed)" in caplog.text,
               "a try that failed too")
        assert not server.client.is_server_ready()
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env()["AWS_ACCESS_KEY_ID"])  # the store answers again
        until(server.client.is_server_ready, "ServerReady once the folders have loaded")
    index = {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}
    assert index == {"echo": ("READY", "")}
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    np.testing.assert_array_equal(echo(server.client, "echo", x), x)
    assert f"{s3.url()}: the model folders are listed at last" in caplog.text and "loading 'echo'" in caplog.text
    assert "not listed in nereid.yaml" not in caplog.text


def test_under_a_watch_a_bucket_that_cannot_be_listed_at_start_keeps_the_server_not_ready_too(
        s3, serve, tmp_path, monkeypatch, caplog, python_folder, bucket_config, until) -> None:
    """Found by a bug hunt: with watch: true (and no models: key) a server started while its bucket could not be
    listed answered ready serving nothing, until its watcher's first listing; the README makes no exception."""
    source = tmp_path / "source"
    python_folder(source, "echo")
    upload_folder(s3.store, source, s3.prefix)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    config = bucket_config(tmp_path, s3.url())
    config.write_text(config.read_text().replace("server:\n", "server:\n  watch: true\n  watch_poll_s: 0.2\n"))
    with caplog.at_level(logging.INFO, logger="nereid.server"):
        server = serve(config)
    # Found by the same hunt: the start-up line named the bucket's local cache folder as what was watched.
    assert f"dynamic repository: polling {s3.url()} every 0.2 s and watching {config} (settle 1000 ms)" \
        in caplog.messages, caplog.messages
    # A poll that could not list it (the review of the tests: after a fixed sleep, it passed with no poll at all).
    until(lambda: "nothing changes until it can be listed" in caplog.text, "a poll that failed to list the bucket")
    assert not server.client.is_server_ready()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env()["AWS_ACCESS_KEY_ID"])  # the store answers again
    until(server.client.is_server_ready, "ServerReady once the watcher has listed the bucket and loaded 'echo'")
    assert {m.name: m.state for m in server.client.get_model_repository_index().models} == {"echo": "READY"}


@pytest.mark.parametrize("watch", [False, True])
def test_an_unload_while_the_bucket_cannot_be_listed_keeps_that_name_unloaded_until_a_load(
        s3, serve, tmp_path, monkeypatch, watch: bool, python_folder, bucket_config, echo, until) -> None:
    """Found by the storage hunt: RepositoryModelUnload of a name the failed listing could not confirm answered
    "it will not be loaded until asked for again", and the listing that answered at last (or the watcher, for a
    folder uploaded later) loaded it all the same."""
    import nereid.store_retries

    monkeypatch.setattr(nereid.store_retries, "STARTUP_LISTING_FIRST_S", 0.1, raising=False)
    source = tmp_path / "source"
    for name in ("echo", "other"):
        python_folder(source, name)
    upload_folder(s3.store, source, s3.prefix)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    config = bucket_config(tmp_path, s3.url())
    if watch:
        config.write_text(config.read_text().replace("server:\n", "server:\n  watch: true\n  watch_poll_s: 0.2\n"))
    server = serve(config)
    for name in ("echo", "late"):
        expect_grpc_error("UNAVAILABLE", lambda: server.client.unload_model(name),
                          "it will not be loaded until asked for again")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env()["AWS_ACCESS_KEY_ID"])  # the store answers again
    until(server.client.is_server_ready, "ServerReady once 'other' has loaded")
    late = tmp_path / "late-source"
    python_folder(late, "late")
    upload_folder(s3.store, late, s3.prefix)  # (under a watch, a new folder of a name unloaded)
    time.sleep(1.5 if watch else 0)  # a few polls, and more than watch_settle_ms
    index = {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}
    assert index["other"] == ("READY", "") and index["echo"] == ("UNAVAILABLE", "unloaded"), index
    assert index["late"][0] == "UNAVAILABLE", index
    server.client.load_model("echo")  # asked for again
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    np.testing.assert_array_equal(echo(server.client, "echo", x), x)


def test_the_index_of_a_bucket_that_cannot_be_listed_says_why_rather_than_list_nothing(s3, serve, tmp_path, monkeypatch,
                                                                                       python_folder,
                                                                                       bucket_config) -> None:
    """Found by a bug hunt: RepositoryIndex answered an empty list, as for an empty repository."""
    source = tmp_path / "source"
    python_folder(source, "echo")
    upload_folder(s3.store, source, s3.prefix)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    server = serve(bucket_config(tmp_path, s3.url()))
    with pytest.raises(InferenceServerException) as caught:
        server.client.get_model_repository_index()
    assert caught.value.status() == "StatusCode.UNAVAILABLE"
    assert caught.value.message().startswith("the model repository cannot be listed now, so its models are not "
                                             f"known: {s3.url()}"), caught.value.message()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env()["AWS_ACCESS_KEY_ID"])  # the store answers again
    assert [m.name for m in server.client.get_model_repository_index().models] == ["echo"]


def test_folders_a_repository_index_lists_first_are_loaded_as_at_start(s3, tmp_path, monkeypatch, python_folder,
                                                                       bucket_config) -> None:
    """Found by the session's review: a RepositoryIndex (or a load) whose listing answered before the start-up
    retry's first step exposed the folders "waiting to load", and nothing ever loaded them: ServerReady false
    for good."""
    from nereid.plugins import make_plugin_manager
    from nereid.repository import ModelRepository
    from nereid.settings import load_settings

    source = tmp_path / "source"
    python_folder(source, "echo")
    upload_folder(s3.store, source, s3.prefix)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    (tmp_path / "scratch").mkdir()
    repository = ModelRepository(load_settings(bucket_config(tmp_path, s3.url())), make_plugin_manager(),
                                 tmp_path / "scratch")
    assert repository.waiting_for_listing()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env()["AWS_ACCESS_KEY_ID"])

    async def scenario() -> list[str]:
        try:
            await repository.refresh()  # a RepositoryIndex that came first
            assert repository.waiting_for_listing()  # (the server starts its loading task on this)
            found = await asyncio.wait_for(repository.list_until_answered(), 10)
            for name in found:
                await repository.load(name)
            return found
        finally:
            await repository.unload_all()
    assert asyncio.run(scenario()) == ["echo"]
    assert not repository.waiting_for_listing()


def test_a_stop_while_the_bucket_is_listed_again_at_start_is_prompt(s3, tmp_path, monkeypatch, bucket_config) -> None:
    """The listing tried again at start (above) never holds up a stop, not even one the store does not answer."""
    import socket

    import nereid.store_retries
    from support import RunningServer

    monkeypatch.setattr(nereid.store_retries, "STARTUP_LISTING_FIRST_S", 0.05, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    server = RunningServer(bucket_config(tmp_path, s3.url()))
    with socket.socket() as silent:  # accepts connections (its backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        silent.settimeout(10)
        connection, _ = silent.accept()  # a listing is under way now, waiting for the silent endpoint (the review
        with connection:  # of the tests: a fixed sleep let the stop come before any listing, and pass as well)
            assert not server.client.is_server_ready()
            started = time.monotonic()
            server.stop()
            assert time.monotonic() - started < 3


def test_a_stopped_server_exits_at_once_while_a_listing_waits_on_a_store_that_does_not_answer(tmp_path) -> None:
    """Found by a bug hunt: "nereid stopped" came at once, but the process exited about 27 s later, when the
    watcher's listing (on asyncio's default executor, whose threads the interpreter joins) got the store client's
    timeout; Kubernetes' 30 s grace then nearly ran out."""
    import signal
    import socket

    from support import free_port, serve_until_listening

    with socket.socket() as silent:  # refuses connections at first (the start lists the bucket), then never answers
        silent.bind(("127.0.0.1", 0))
        config = tmp_path / "nereid.yaml"
        config.write_text(f'server:\n  bind_addr: "127.0.0.1:{free_port()}"\n  http_addr: ""\n  metrics_addr: ""\n'
                          f'  ml_backends_path: "s3://bucket/models"\n  cache_dir: "{tmp_path / "cache"}"\n'
                          "  watch: true\n  watch_poll_s: 0.2\n")
        env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.getsockname()[1]}",
               "AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret", "AWS_ALLOW_HTTP": "true",
               "AWS_REGION": "us-east-1"}
        process, lines = serve_until_listening(config, env)
        try:
            silent.listen(64)  # from now on a store that takes connections and never answers
            silent.settimeout(20)
            silent.accept()[0].close()  # a listing is under way, waiting on the silent store
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            assert process.wait(20) == 0, "".join(lines) + process.stdout.read()
            assert time.monotonic() - started < 5, "".join(lines) + process.stdout.read()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def watched_bucket(s3, serve, tmp_path: Path, python_folder, bucket_config, echo):
    """``watched_bucket(poll_s, settle_ms)``: a bucket holding the echo model 'first', served with ``watch`` (polled
    every ``poll_s``); (server, the local source folder to upload more from, an input 'first' echoed)."""
    def start(poll_s: float, settle_ms: int):
        source = tmp_path / "source"
        python_folder(source, "first")
        upload_folder(s3.store, source, s3.prefix)
        config = bucket_config(tmp_path, s3.url())
        config.write_text(config.read_text().replace("server:\n", f"server:\n  watch: true\n  watch_poll_s: {poll_s}\n"
                                                                     f"  watch_settle_ms: {settle_ms}\n"))
        server = serve(config)
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        np.testing.assert_array_equal(echo(server.client, "first", x), x)
        return server, source, x
    return start


def test_a_reload_of_a_serving_model_the_store_failed_is_tried_again_once_it_answers(s3, serve, tmp_path, monkeypatch,
                                                                                     echo, until,
                                                                                     watched_bucket) -> None:
    """Found by a bug hunt: a RepositoryModelLoad of a serving model while the store was unreachable failed (503,
    right), and nothing tried it again: the index kept "reload failed ... cannot reach the store" beside READY for
    good, where an unloaded model's failed load is tried again."""
    server, _, x = watched_bucket(0.2, 300)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    with pytest.raises(InferenceServerException) as failed:
        server.client.load_model("first")
    assert failed.value.status() == "StatusCode.UNAVAILABLE", failed.value.message()
    index = {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}
    assert index["first"][0] == "READY" and "InvalidAccessKeyId" in index["first"][1], index
    generation = server.server.repository.generation("first")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env()["AWS_ACCESS_KEY_ID"])  # the store answers again

    def reason() -> str:
        return {m.name: m.reason for m in server.client.get_model_repository_index().models}["first"]
    until(lambda: reason() == "", "the reload tried again")
    # (Its objects are those the running version loaded: it is the folder as it is now, and not loaded again.)
    assert server.server.repository.generation("first") == generation
    np.testing.assert_array_equal(echo(server.client, "first", x), x)


def test_a_watched_bucket_is_polled_models_appear_change_and_go(s3, serve, tmp_path, python_folder, echo, until,
                                                                watched_bucket) -> None:
    server, source, x = watched_bucket(0.2, 300)

    def until(check, what: str) -> None:
        deadline = time.monotonic() + 20
        while not check():
            assert time.monotonic() < deadline, f"not within 20 s: {what}"
            time.sleep(0.1)

    def states() -> dict[str, str]:
        return {m.name: m.state for m in server.client.get_model_repository_index().models}

    # A folder uploaded to the bucket appears by itself.
    python_folder(source, "second")
    upload_folder(s3.store, source / "second", f"{s3.prefix}/second")
    until(lambda: states().get("second") == "READY", "the uploaded folder is READY")
    np.testing.assert_array_equal(echo(server.client, "second", x), x)
    # A changed main.py is reloaded (with no downtime: the old version answers until then).
    obstore.put(s3.store, f"{s3.prefix}/first/main.py", textwrap.dedent(DOUBLE_MAIN).encode())
    until(lambda: echo(server.client, "first", x).tolist() == (2 * x).tolist(), "the new main.py answers")
    # A folder deleted from the bucket is unloaded and forgotten (no RepositoryIndex needed: its cached copy
    # used to keep the name known), and its cached copy goes.
    mirror = server.server.settings.server.ml_backends_path
    assert (mirror / "second" / "main.py").is_file()
    # A request for a name the server does not know lists the store (for the next requests): 'second' is in
    # that listing, kept for a few seconds.
    with pytest.raises(InferenceServerException, match="unknown model 'typo'"):
        server.client.get_inference_statistics("typo")
    until(lambda: not any(t.name == "nereid-store-listing" for t in threading.enumerate()), "the listing ends")
    for key in bucket_state(s3.store, f"{s3.prefix}/second/"):
        obstore.delete(s3.store, key)
    until(lambda: "second" not in {e.name for e in server.server.repository.entries()}, "'second' is forgotten")
    # Forgotten, the name is unknown, though that listing still held it: a request used to give it an entry
    # again ("new folder: it loads once it has been unchanged...", UNAVAILABLE for ever), and a load then
    # failed INTERNAL and held ServerReady false.
    with pytest.raises(InferenceServerException, match="unknown model 'second'") as gone:
        echo(server.client, "second", x)
    assert gone.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as load:
        server.client.load_model("second")
    assert load.value.status() == "StatusCode.NOT_FOUND", load.value.message()
    assert server.client.is_server_ready()
    until(lambda: not (mirror / "second").exists() and not (mirror / ".second.lock").exists(),
          "the copy of 'second' leaves the cache")
    assert "second" not in states()


def test_a_reload_finds_a_folder_the_cached_listing_does_not_know(s3, tmp_path, python_folder, bucket_config) -> None:
    # The watcher asks for a reload of a folder its own poll saw; the listing kept for unknown request
    # names may be seconds older. The reload must look again, not answer NOT_FOUND.
    import asyncio

    from nereid.plugins import make_plugin_manager
    from nereid.model_entry import ModelState
    from nereid.repository import ModelRepository
    from nereid.storage import model_folder_exists

    source = tmp_path / "source"
    python_folder(source, "early")
    upload_folder(s3.store, source, s3.prefix)
    settings = load_settings(bucket_config(tmp_path, s3.url()))
    (tmp_path / "scratch").mkdir()
    repo = ModelRepository(settings, make_plugin_manager(), tmp_path / "scratch")
    assert not model_folder_exists(settings.server, "late")  # a fresh listing, kept for a few seconds
    python_folder(source, "late")
    upload_folder(s3.store, source / "late", f"{s3.prefix}/late")

    async def scenario():
        entry = await repo.reload("late")
        assert entry.state is ModelState.READY, entry.reason
        await repo.unload_all()
    asyncio.run(scenario())


def test_a_listed_folder_missing_from_the_bucket_names_its_url(s3, serve, tmp_path, python_folder,
                                                               bucket_config) -> None:
    source = tmp_path / "source"
    python_folder(source, "echo")
    upload_folder(s3.store, source, s3.prefix)
    server = serve(bucket_config(tmp_path, s3.url(), "- name: echo\n- name: absent\n"))
    index = {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}
    assert index["echo"][0] == "READY"
    assert index["absent"] == ("UNAVAILABLE", f"{s3.url('absent')}: no such model folder (no objects under it)")


def test_nereid_check_reads_an_s3_repository(s3, tmp_path, capsys, python_folder, bucket_config) -> None:
    from nereid.cli import main

    source = tmp_path / "source"
    python_folder(source, "echo")
    upload_folder(s3.store, source, s3.prefix)
    assert main(["check", "--config", str(bucket_config(tmp_path, s3.url()))]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("echo: OK backend=python")
    assert not any(p.suffix == ".safetensors" for p in iter_files(tmp_path / "cache"))


def test_nereid_check_on_a_bucket_it_cannot_list_prints_the_stores_reason_and_fails(s3, tmp_path, capsys, monkeypatch,
                                                                                    python_folder,
                                                                                    bucket_config) -> None:
    """Defect (found by a bug hunt): without a models: key, a bucket that could not be listed (wrong credentials,
    no such bucket, nothing at the endpoint) printed only "nereid.yaml: OK" and exited 0; the store's reason was
    an ERROR line on stderr. CI gating on the check passed a deployment that serves nothing."""
    from nereid.cli import main

    source = tmp_path / "source"
    python_folder(source, "echo")
    upload_folder(s3.store, source, s3.prefix)
    config = bucket_config(tmp_path, s3.url())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    assert main(["check", "--config", str(config)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{s3.url()}: cannot list the model folders: HTTP 403 Forbidden InvalidAccessKeyId"), \
        lines
    assert "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in lines[0]
    assert lines[1:] == [f"{config}: its model folders cannot be listed"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env()["AWS_ACCESS_KEY_ID"])
    missing = f"s3://no-such-bucket/{s3.prefix}"
    assert main(["check", "--config", str(bucket_config(tmp_path, missing))]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{missing}: cannot list the model folders: HTTP 404 Not Found NoSuchBucket"), lines
    assert main(["check", "--config", str(bucket_config(tmp_path, s3.url()))]) == 0  # (the store answers: checked)
    assert capsys.readouterr().out.splitlines()[0].startswith("echo: OK backend=python")


def test_the_shipped_examples_and_config_serve_from_a_bucket(s3, tmp_path, capsys) -> None:
    # The README's MinIO recipe: `aws s3 sync ml-backends s3://.../prod`, then only ml_backends_path changes.
    from nereid.cli import main

    shipped = Path(__file__).resolve().parents[3]
    for folder in sorted((shipped / "ml-backends").iterdir()):
        upload_folder(s3.store, folder, f"{s3.prefix}/{folder.name}")  # (.cache/ is left out)
    config = (shipped / "nereid.yaml").read_text()
    assert 'ml_backends_path: "ml-backends"' in config
    config = config.replace('ml_backends_path: "ml-backends"',
                            f'ml_backends_path: "{s3.url()}"\n  cache_dir: "{tmp_path / "cache"}"')
    (tmp_path / "nereid.yaml").write_text(config)
    assert main(["check", "--config", str(tmp_path / "nereid.yaml")]) == 0, capsys.readouterr().out
    ok = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if ": OK backend=" in line]
    assert sorted(ok) == sorted(p.name for p in (shipped / "ml-backends").iterdir() if not p.name.startswith("."))


def test_a_watched_folder_of_only_its_folder_object_says_why_and_loads_once_files_come(s3, serve, tmp_path,
                                                                                       python_folder, echo, until, boto,
                                                                                       watched_bucket) -> None:
    server, source, x = watched_bucket(0.2, 300)
    boto.put_object(Bucket="models", Key=f"{s3.prefix}/newmodel/", Body=b"")

    def reason() -> str:
        return {m.name: m.reason for m in server.client.get_model_repository_index().models}.get("newmodel", "")

    until(lambda: "holds no files" in reason(), "the folder's load says why it cannot load")
    assert reason().endswith("upload the model's files into it")
    python_folder(source, "newmodel")
    upload_folder(s3.store, source / "newmodel", f"{s3.prefix}/newmodel")
    until(lambda: server.client.is_model_ready("newmodel"), "the folder loads once its files are there")
    np.testing.assert_array_equal(echo(server.client, "newmodel", x), x)


def test_a_load_during_a_store_outage_is_unavailable_with_the_stores_reason(s3, serve, tmp_path, monkeypatch,
                                                                            python_folder, bucket_config) -> None:
    # Defect: a model that IS in the bucket, asked for while the store refused the credentials (or could not be
    # reached), answered NOT_FOUND "no folder 'p-new' under ml_backends_path"; the reason was only in the log.
    from support import expect_grpc_error, free_port

    source = tmp_path / "source"
    python_folder(source, "p0")
    upload_folder(s3.store, source, s3.prefix)
    server = serve(bucket_config(tmp_path, s3.url(), "- name: p0\n"))
    python_folder(source, "p-new")
    upload_folder(s3.store, source / "p-new", f"{s3.prefix}/p-new")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    message = expect_grpc_error("UNAVAILABLE", lambda: server.client.load_model("p-new"),
                                f"model 'p-new': cannot tell whether its folder is in the store: {s3.url()}: ",
                                "HTTP 403 Forbidden InvalidAccessKeyId", "check AWS_ACCESS_KEY_ID")
    assert "Traceback" not in message and "ml_backends_path" not in message
    # An unload asked for then: no NOT_FOUND either (a review found it said there was no such folder).
    expect_grpc_error("UNAVAILABLE", lambda: server.client.unload_model("p-new"),
                      f"model 'p-new': cannot tell whether its folder is in the store: {s3.url()}: ",
                      "nothing is loaded under this name, and it will not be loaded until asked for again")
    # A name no folder can have is unknown whatever the store says, as a load answers it.
    expect_grpc_error("NOT_FOUND", lambda: server.client.unload_model(".hidden"), "unknown model '.hidden'")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env()["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    import nereid.repository

    looked_up: list[str] = []
    holds = nereid.repository.store_holds_folder
    monkeypatch.setattr(nereid.repository, "store_holds_folder",
                        lambda server, name: looked_up.append(name) or holds(server, name))
    expect_grpc_error("UNAVAILABLE", lambda: server.client.load_model("p-new"), "cannot reach the store",
                      "check the endpoint (AWS_ENDPOINT_URL")
    # (A bug hunt: against a store that hangs, the load listed by name after the listing failed: 60 s, not 30.)
    assert looked_up == [], "the folder was looked for by name in a store that could not be reached"
    # A load of a model loaded already, its store down: UNAVAILABLE too, not INTERNAL "failed to load" (a fault
    # of the model's), and the version loaded before serves on.
    message = expect_grpc_error("UNAVAILABLE", lambda: server.client.load_model("p0"),
                                "failed to load model 'p0' from its store: reload failed, the running version "
                                "keeps serving: ", "cannot reach the store", "check the endpoint (AWS_ENDPOINT_URL")
    assert server.client.is_model_ready("p0"), message
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)  # back: it loads, and a name it lacks is NOT_FOUND again
    # Without watch nothing loads it by itself, so the loads that failed leave the server ready once listed
    # (a review found them holding ServerReady false for good after any RepositoryIndex).
    server.client.get_model_repository_index()
    assert server.client.is_server_ready()
    server.client.load_model("p-new")
    assert server.client.is_model_ready("p-new")
    expect_grpc_error("NOT_FOUND", lambda: server.client.load_model("absent"),
                      "unknown model 'absent' (no folder 'absent' under ml_backends_path)")


def test_a_folder_loaded_by_request_and_deleted_before_the_watcher_saw_it_is_unloaded(s3, serve, tmp_path,
                                                                                      python_folder, echo,
                                                                                      watched_bucket) -> None:
    """A folder uploaded, loaded at once by RepositoryModelLoad and deleted before the watcher's next look showed
    the watcher no change (never seen, not there): its model served for good. Now its absence is a removal."""
    server, source, x = watched_bucket(0.5, 200)
    watcher = server.server.watcher
    python_folder(source, "late")
    upload_folder(s3.store, source / "late", f"{s3.prefix}/late")
    server.client.load_model("late")  # before the watcher's next look, or not: either way it must go below
    for key in bucket_state(s3.store, f"{s3.prefix}/late/"):
        obstore.delete(s3.store, key)
    deadline = time.monotonic() + 15
    while server.client.is_model_ready("late"):
        assert time.monotonic() < deadline, f"'late' still served, its folder gone ({watcher.scans} scans)"
        time.sleep(0.1)
    with pytest.raises(InferenceServerException, match="late"):
        echo(server.client, "late", x)
