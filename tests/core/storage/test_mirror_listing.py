"""Listing a bucket's model folders (``nereid.storage.mirror`` and the listing ``nereid.storage`` keeps), against a
real S3 API (moto): folder objects, keys the store client cannot read, and mirrors of earlier nereid versions."""

from __future__ import annotations

import logging
import time

import numpy as np
import obstore
import pytest
from tritonclient.utils import InferenceServerException

from moto_s3 import upload_folder
from nereid.settings import load_settings
from nereid.storage import parse_store_url


def test_a_mirror_an_earlier_nereid_named_by_the_url_alone_is_said_to_be_unused(s3, tmp_path, caplog,
                                                                                bucket_config) -> None:
    # Told apart by endpoint since, a store reached at its own endpoint (moto's here) gets a new mirror folder:
    # the old one, fetched files and compiled programs, would stay on disk unseen.
    from nereid.storage import scan_model_folders

    obstore.put(s3.store, f"{s3.prefix}/m/main.py", b"print(1)")
    server = load_settings(bucket_config(tmp_path, s3.url())).server
    earlier = server.ml_backends_path.parent / parse_store_url(s3.url()).cache_name()
    assert earlier != server.ml_backends_path  # (moto's endpoint is in the environment)
    (earlier / "m").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="nereid.storage"):
        for _ in range(2):
            assert scan_model_folders(server) == ["m"]
    assert [r.getMessage() for r in caplog.records if "earlier nereid" in r.getMessage()] == [
        f"{s3.url()}: the local mirror {earlier}, made by an earlier nereid before mirrors were told apart by the "
        f"store's endpoint, is no longer used (the models are fetched again into {server.ml_backends_path}); "
        "delete it, unless a server of a nereid older than this one at the store provider's own endpoint shares "
        "this cache_dir"]


def test_the_mirror_of_a_server_at_the_providers_own_endpoint_is_never_said_to_be_unused(s3, tmp_path, caplog,
                                                                                         monkeypatch,
                                                                                         bucket_config) -> None:
    """Defect (found by a bug hunt): a server at the provider's own endpoint (AWS) names its mirror by the URL
    alone, as earlier versions named every one; a server at another endpoint (a MinIO) sharing the cache_dir said
    at WARNING that this live mirror, fetched files and compiled programs, was an earlier nereid's: "delete it"."""
    import nereid.storage
    from nereid.storage import scan_model_folders

    obstore.put(s3.store, f"{s3.prefix}/m/main.py", b"print(1)")
    config = bucket_config(tmp_path, s3.url())
    with monkeypatch.context() as aws:  # AWS itself, which this machine cannot reach: its listing is made up
        for variable in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
            aws.delenv(variable, raising=False)
        aws.setattr(nereid.storage, "_list_remote", lambda location, root: ["m"])
        at_aws = load_settings(config).server
        assert at_aws.ml_backends_path.name == parse_store_url(s3.url()).cache_name()
        assert scan_model_folders(at_aws) == ["m"]
    server = load_settings(config).server
    assert server.ml_backends_path != at_aws.ml_backends_path
    with caplog.at_level(logging.WARNING, logger="nereid.storage"):
        assert scan_model_folders(server) == ["m"]
    assert [r.getMessage() for r in caplog.records if "earlier nereid" in r.getMessage()] == []


def test_a_folder_of_only_its_folder_object_is_a_model_folder_to_the_watcher_as_to_the_listing(s3, tmp_path,
                                                                                               bucket_config,
                                                                                               boto) -> None:
    """Defect (found by a bug hunt): the repository's listing counted a folder holding only its "Create folder"
    object ("newmodel/") and the watcher's scan did not, so under a watch it said "new folder: it loads once it
    has been unchanged..." for ever. Both count it, as both count an empty local folder; its load names why it
    cannot load. A file directly under the URL, and a folder of hidden files, are no model folders to either."""
    from nereid.errors import ConfigError
    from nereid.folder_states import scan_store
    from nereid.storage import StorageError, materialize_model_folder
    from nereid.storage.mirror import list_remote_folders
    from moto_s3 import BUCKET

    client = boto
    for key, body in [("newmodel/", b""), ("junk/main.py~", b"x"), ("README", b""), ("notes.txt", b"text"),
                      (".hidden/main.py", b"x"), ("echo/", b""), ("echo/main.py", b"print()")]:
        client.put_object(Bucket=BUCKET, Key=f"{s3.prefix}/{key}", Body=body)
    location = parse_store_url(s3.url())
    for _ in range(2):  # (the second from what the first asked of the store)
        states = scan_store(location)
        assert sorted(states) == list_remote_folders(location) == ["echo", "junk", "newmodel"]
    assert states["newmodel"].stamp == states["junk"].stamp == ()
    server = load_settings(bucket_config(tmp_path, s3.url())).server
    with pytest.raises(ConfigError) as raised:
        materialize_model_folder(server, "newmodel")
    assert not isinstance(raised.value, StorageError)  # the folder's own fault: not tried again until it changes
    assert str(raised.value) == (f"{s3.url('newmodel')}: the model folder holds no files, only folder objects (keys "
                                 "ending in '/', as a console's \"Create folder\" makes): upload the model's files "
                                 "into it")


def test_a_key_obstore_cannot_read_fails_only_its_folder(s3, serve, tmp_path, caplog, python_folder, bucket_config,
                                                         echo, boto) -> None:
    # S3 takes keys with a tab, '//' or '..' segments; obstore refuses them and drops the whole listing page
    # holding one. Only the folder holding one may fail (naming the key); a stray one is skipped with a warning.
    from moto_s3 import BUCKET
    from nereid.storage import StoreURL
    from nereid.folder_states import scan_store

    source = tmp_path / "source"
    python_folder(source, "echo")
    python_folder(source, "new1")
    upload_folder(s3.store, source, s3.prefix)
    client = boto
    client.put_object(Bucket=BUCKET, Key=f"{s3.prefix}/new1/notes/a\tb.txt", Body=b"a tab in its name")
    server = serve(bucket_config(tmp_path, s3.url()))
    x = np.arange(4, dtype=np.float32).reshape(1, 4)

    def index() -> dict[str, tuple[str, str]]:
        return {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}

    assert index()["echo"] == ("READY", "")
    assert index()["new1"][0] == "UNAVAILABLE" and "new1/notes/a\\tb.txt" in index()["new1"][1], index()
    # Keys that break the listing of the folders themselves: the other folders still list, load and serve.
    for key in ("/x", "stray\tkey", "echo/../x"):
        client.put_object(Bucket=BUCKET, Key=f"{s3.prefix}/{key}", Body=b"bad")
    python_folder(source, "zz")
    upload_folder(s3.store, source / "zz", f"{s3.prefix}/zz")
    assert set(index()) == {"echo", "new1", "zz"}
    server.client.load_model("zz")
    with pytest.raises(InferenceServerException, match=r"echo/\.\./x' cannot be read"):
        server.client.load_model("echo")
    # Loaded again, it failed: the running version serves on, the index says why.
    assert index()["echo"][0] == "READY" and "echo/../x" in index()["echo"][1]
    client.delete_object(Bucket=BUCKET, Key=f"{s3.prefix}/echo/../x")
    server.client.load_model("echo")
    for model in ("echo", "zz"):
        np.testing.assert_array_equal(echo(server.client, model, x), x)
    assert "skipping the object key" in caplog.text and "stray\\tkey" in caplog.text
    # Watch mode's poll lists every folder: the one holding a bad key is there, with a state naming the key.
    states = scan_store(StoreURL("s3", BUCKET, s3.prefix))
    assert set(states) == {"echo", "new1", "zz"}
    assert any("unreadable key" in str(stamp) for stamp in states["new1"].stamp)


def test_folders_an_unreadable_key_may_hide_are_logged_and_known_ones_still_listed(s3, tmp_path, caplog, python_folder,
                                                                                   bucket_config, boto) -> None:
    # A key directly under the URL ('//x/main.py') breaks the listing by folder, so the folders are found by
    # listing every key; obstore then drops the whole 1,000-key page holding 'mid/../e.txt', and 'good' listed
    # before it in that page with it. No obstore listing reaches 'good' without that page (a prefix is whole
    # folders, a listing has no end): the log says so, a folder seen before is looked at by itself, and a
    # load by name still works.
    import logging

    from moto_s3 import BUCKET
    from nereid.storage import materialize_model_folder, scan_model_folders

    source = tmp_path / "source"
    python_folder(source, "good")
    python_folder(source, "mid")
    upload_folder(s3.store, source, s3.prefix)
    client = boto
    for key in ("mid/../e.txt", "/x/main.py"):
        client.put_object(Bucket=BUCKET, Key=f"{s3.prefix}/{key}", Body=b"bad")
    server = load_settings(bucket_config(tmp_path, s3.url())).server
    with caplog.at_level(logging.WARNING, logger="nereid.storage.mirror"):
        assert "mid" in scan_model_folders(server)
    assert f"object key '{s3.prefix}/mid/../e.txt' cannot be read (the load of 'mid' fails naming it)" in caplog.text
    assert "a model folder whose keys all come just before it in the listing (in its page of 1,000 keys) is not " \
           "found unless this server, or one sharing its cache_dir, listed that folder before" in caplog.text
    (server.ml_backends_path / "good").mkdir(exist_ok=True)  # listed before (by an earlier server, say)
    assert scan_model_folders(server) == ["good", "mid"]
    assert (materialize_model_folder(server, "good") / "main.py").is_file()


def test_a_listing_that_started_before_a_name_was_forgotten_does_not_bring_it_back(tmp_path) -> None:
    """5ab2d98 took a forgotten name out of the kept listing, but a slower listing started before the deletion
    (for an unknown name's request) then replaced it, the name included: a request gave the deleted folder an
    entry again (UNAVAILABLE for ever where NOT_FOUND is right), and a load failed INTERNAL."""
    from nereid.settings import ServerSettings
    from nereid.storage import _record_listing, forget_listed_folder, model_folder_exists

    server = ServerSettings(ml_backends_path=tmp_path, ml_backends_url="s3://listing-race/models")
    location = parse_store_url(server.ml_backends_url)
    slow_started = time.monotonic()  # the slow listing starts while 'second' is in the bucket
    _record_listing(location, frozenset({"first", "second"}), time.monotonic())  # a quicker one, kept
    forget_listed_folder(server, "second")  # the watcher saw it go
    assert not model_folder_exists(server, "second")
    _record_listing(location, frozenset({"first", "second"}), slow_started)  # the slow one ends last
    assert not model_folder_exists(server, "second") and model_folder_exists(server, "first")
    # One started after the forget tells the truth, whatever it is: uploaded again, the folder is back.
    _record_listing(location, frozenset({"first", "second"}), time.monotonic())
    assert model_folder_exists(server, "second")


def test_ancestor_paths_are_every_folder_above_each_key_at_any_depth() -> None:
    # The watcher's scan and the mirror both tell a folder object from a file by it: a folder object two levels
    # above the deepest key is a folder too, not an empty file to ask the store about.
    from nereid.storage.mirror import ancestor_paths

    assert ancestor_paths(["m/a/b/c/x.txt", "m/main.py", "top"]) == {"m", "m/a", "m/a/b", "m/a/b/c"}
    assert ancestor_paths([]) == set()


def test_a_listing_walking_keys_while_another_adds_a_known_folder_goes_on(s3, tmp_path, python_folder, boto,
                                                                          monkeypatch) -> None:
    """The thread-safety hunt: a listing that walks every key (a key directly under the URL) looks at each folder
    seen before, one store call each, iterating the set another thread's listing adds to in place (the watcher's
    refresh beside a load's scan): "RuntimeError: Set changed size during iteration"."""
    import threading

    from moto_s3 import BUCKET
    from nereid.storage import mirror

    source = tmp_path / "source"
    python_folder(source, "good")
    upload_folder(s3.store, source, s3.prefix)
    boto.put_object(Bucket=BUCKET, Key=f"{s3.prefix}//x/main.py", Body=b"bad")  # breaks the listing by folder
    location = parse_store_url(s3.url())
    assert mirror.list_remote_folders(location, known=["good", "gone"]) == ["good"]
    real = mirror._folder_exists
    beside: list[object] = []

    def another_listing_meanwhile(*args):
        if not beside:  # (the other listing's own looks go straight to the store)
            beside.append(None)
            other = threading.Thread(target=lambda: beside.append(mirror.list_remote_folders(location, ["new"])))
            other.start()
            other.join(30)
        return real(*args)

    monkeypatch.setattr(mirror, "_folder_exists", another_listing_meanwhile)
    assert mirror.list_remote_folders(location) == ["good"]
    assert beside == [None, ["good"]]
