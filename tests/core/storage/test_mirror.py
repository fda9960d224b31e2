"""The local mirror of a bucket's model folder (``nereid.storage.mirror``), against a real S3 API on the loopback
(moto; see tests/moto_s3.py): where it goes, which objects become which files, and what is fetched again."""

from __future__ import annotations

import time

import numpy as np
import obstore
import pytest

from moto_s3 import BUCKET, iter_files, upload_folder
from nereid.errors import ConfigError
from nereid.settings import load_settings
from nereid.storage import StoreURL, mirror_root
from nereid.storage.mirror import MARKER_FILE, read_marker


def test_one_url_on_two_stores_gets_two_mirrors(tmp_path, monkeypatch) -> None:
    """Defect: the mirror was named by the URL alone, so a MinIO server and an AWS one, both s3://models/prod on one
    cache_dir (the default ~/.cache/nereid), served and deleted each other's files."""
    location = StoreURL("s3", "models", "prod")
    for variable in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        monkeypatch.delenv(variable, raising=False)
    default = mirror_root(tmp_path, location)
    assert default.name == location.cache_name()  # the provider's own endpoint: the name it always had
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio-a:9000")
    first = mirror_root(tmp_path, location)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://USER:secret@Minio-A:9000/")  # the same store
    assert mirror_root(tmp_path, location) == first
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://minio-b:9000")  # read first: another store
    second = mirror_root(tmp_path, location)
    assert len({default, first, second}) == 3
    assert all(path.parent == tmp_path / "repositories" and path.name.startswith("s3-models-prod-")
               for path in (default, first, second))


def test_a_url_repository_mirrors_into_the_cache_folder(tmp_path) -> None:
    config = tmp_path / "nereid.yaml"
    config.write_text('server:\n  ml_backends_path: "s3://models/prod"\n  cache_dir: "cache"\n'
                      'models:\n  - name: not_checked_locally\n')
    settings = load_settings(config)
    assert settings.server.ml_backends_url == "s3://models/prod"
    assert settings.server.cache_dir == tmp_path / "cache"
    assert settings.server.ml_backends_path == mirror_root(tmp_path / "cache", StoreURL("s3", "models", "prod"))
    config.write_text('server:\n  ml_backends_path: "s3://models/prod"\n  watch: true\n  watch_poll_s: 2.5\n')
    assert (load_settings(config).server.watch, load_settings(config).server.watch_poll_s) == (True, 2.5)
    config.write_text('server:\n  ml_backends_path: "s3://models/prod"\n  watch: true\n  watch_poll_s: 0\n')
    with pytest.raises(ConfigError, match="server.watch_poll_s"):
        load_settings(config)


def test_a_model_s_hidden_files_are_fetched_and_the_server_s_own_names_are_not(s3, tmp_path, python_folder,
                                                                               bucket_config, boto) -> None:
    """Found by a bug hunt: hidden files were skipped, so a main.py reading its .scale, or a cpp model including
    .gen/factor.h, worked from a local folder and failed from a bucket. A .cache/ (a build uploaded by mistake)
    and the server's .nereid-* names stay out; a hidden file gone from the bucket goes from the mirror."""
    from nereid.storage import materialize_model_folder

    source = tmp_path / "source"
    folder = python_folder(source, "hid")
    (folder / ".scale").write_text("160")
    (folder / ".gen").mkdir()
    (folder / ".gen" / "factor.h").write_text("#define FACTOR 3\n")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "built.so").write_bytes(b"not for the server")
    (folder / ".nereid-remote.json").write_text("{}")
    upload_folder(s3.store, source, s3.prefix)
    server = load_settings(bucket_config(tmp_path, s3.url())).server
    local = materialize_model_folder(server, "hid")
    assert (local / ".scale").read_text() == "160" and (local / ".gen" / "factor.h").exists()
    assert not (local / ".cache" / "built.so").exists()
    assert {".scale", ".gen/factor.h"} <= set(read_marker(local).fetched)
    assert not {name for name in read_marker(local).fetched if name.startswith((".cache", ".nereid-"))}
    boto.delete_object(Bucket=BUCKET, Key=f"{s3.prefix}/hid/.scale")
    local = materialize_model_folder(server, "hid")
    assert not (local / ".scale").exists() and (local / ".gen" / "factor.h").exists()


def test_console_folder_markers_are_skipped_and_a_file_folder_clash_is_named(s3, tmp_path, bucket_config) -> None:
    # The AWS console's "Create folder" (and `aws s3api put-object --key dir/`) stores a zero-byte object
    # whose key ends in "/"; the listing shows it without the slash, named like the folder itself.
    import boto3

    from moto_s3 import ACCESS_KEY, BUCKET, REGION, SECRET_KEY
    from nereid.storage import StorageError, materialize_model_folder

    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY)
    for key, body in [("", b""), ("echo/", b""), ("echo/helpers/", b""), ("echo/helpers/note.txt", b"a note"),
                      ("echo/main.py", b"print()"), ("clash/main.py", b"print()"), ("clash/main.py/x", b"y")]:
        client.put_object(Bucket=BUCKET, Key=f"{s3.prefix}/{key}", Body=body)
    server = load_settings(bucket_config(tmp_path, s3.url())).server
    local = materialize_model_folder(server, "echo")
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.name != MARKER_FILE) == [
        "helpers", "helpers/note.txt", "main.py"]
    assert set(read_marker(local).fetched) == {"helpers/note.txt", "main.py"}
    with pytest.raises(StorageError, match=r"clash: object key '.*clash/main.py' is both a file \(7 bytes\) and the "
                                           "folder of other objects"):
        materialize_model_folder(server, "clash")


def test_the_marker_of_an_empty_folder_is_skipped_and_empty_files_are_kept(s3, tmp_path, bucket_config, boto) -> None:
    # "Create folder" on an empty folder stores "m3/empty/" with nothing under it; obstore lists it as a
    # zero-byte "m3/empty", exactly like an empty file (an __init__.py), but it cannot be fetched by that name.
    from moto_s3 import BUCKET
    from nereid.storage import materialize_model_folder

    client = boto
    for key, body in [("m3/", b""), ("m3/empty/", b""), ("m3/pkg/__init__.py", b""), ("m3/main.py", b"print()"),
                      ("m3/data", b"bytes"), ("m3/data/", b"")]:  # a file and a marker of the same name
        client.put_object(Bucket=BUCKET, Key=f"{s3.prefix}/{key}", Body=body)
    server = load_settings(bucket_config(tmp_path, s3.url())).server
    local = materialize_model_folder(server, "m3")
    assert {p.relative_to(local).as_posix(): p.read_bytes() for p in iter_files(local) if p.name != MARKER_FILE} == {
        "pkg/__init__.py": b"", "main.py": b"print()", "data": b"bytes"}
    assert not (local / "empty").exists()
    assert set(read_marker(local).fetched) == {"pkg/__init__.py", "main.py", "data"}
    assert materialize_model_folder(server, "m3") == local  # and again, from the cache


def test_a_folder_object_holding_bytes_is_named_by_its_own_key(s3, tmp_path, bucket_config, boto) -> None:
    """Defect (found by a bug hunt): obstore lists "m/dir/" as "m/dir", and a load of a folder holding such an
    object with bytes named a key that does not exist ("cannot fetch: ... NoSuchKey", "object key 'm2' is both
    a file and the folder of other objects"). It names the key that is in the bucket."""
    from moto_s3 import BUCKET
    from nereid.storage import StorageError, materialize_model_folder

    client = boto
    for key, body in [("m/main.py", b"print()"), ("m/dir/", b"abc"), ("m2/", b"abc"), ("m2/main.py", b"print()"),
                      ("m3/main.py", b"print()"), ("m3/pkg/", b"abc"), ("m3/pkg/x.py", b"")]:
        client.put_object(Bucket=BUCKET, Key=f"{s3.prefix}/{key}", Body=body)
    server = load_settings(bucket_config(tmp_path, s3.url())).server
    for name, key in [("m", "m/dir/"), ("m2", "m2/"), ("m3", "m3/pkg/")]:
        with pytest.raises(StorageError) as raised:
            materialize_model_folder(server, name)
        assert str(raised.value) == (
            f"{s3.url(name)}: object key '{s3.prefix}/{key}' holds 3 bytes, but a key ending in '/' is a folder's "
            "own object, which nereid's store client (obstore) cannot read: delete it, or upload the file under a "
            "key without the trailing '/'")


def test_a_folder_name_too_long_for_the_local_disk_fails_only_its_own_load(s3, serve, tmp_path, python_folder,
                                                                           bucket_config, echo) -> None:
    # S3 takes a 300-character folder name; a local file system takes 255 bytes per name.
    long_name = "m" * 300
    source = tmp_path / "source"
    python_folder(source, "echo")
    upload_folder(s3.store, source, s3.prefix)
    upload_folder(s3.store, source / "echo", f"{s3.prefix}/{long_name}")
    server = serve(bucket_config(tmp_path, s3.url()))  # it starts
    index = {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}
    assert index["echo"] == ("READY", "")
    # (The storage hunt: the reason was the raw "[Errno 36] File name too long: '<scratch>/mmm...'".)
    assert index[long_name] == ("UNAVAILABLE", f"model '{'m' * 64}' (236 more characters cut): its name is 300 bytes, "
                                "and the server keeps a local folder of that name (its scratch folder, a bucket's "
                                "mirror): a local file system allows 255 bytes per name; give the model folder a "
                                "shorter name"), index
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    np.testing.assert_array_equal(echo(server.client, "echo", x), x)
    from nereid.storage import materialize_model_folder

    _refused_as_too_long(lambda: materialize_model_folder(server.server.settings.server, long_name),
                         f"{s3.url(long_name)}: cannot make its folder in")


def test_a_path_that_turns_from_a_file_into_a_folder_and_back_is_fetched(s3, tmp_path, bucket_config) -> None:
    from nereid.storage import materialize_model_folder

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    obstore.put(s3.store, f"{s3.prefix}/flip/main.py", b"print()")
    obstore.put(s3.store, f"{s3.prefix}/flip/data", b"a file")
    local = materialize_model_folder(server, "flip")
    assert (local / "data").read_bytes() == b"a file"
    obstore.delete(s3.store, f"{s3.prefix}/flip/data")
    obstore.put(s3.store, f"{s3.prefix}/flip/data/x.txt", b"now a folder")
    materialize_model_folder(server, "flip")
    assert (local / "data" / "x.txt").read_bytes() == b"now a folder"
    obstore.delete(s3.store, f"{s3.prefix}/flip/data/x.txt")
    obstore.put(s3.store, f"{s3.prefix}/flip/data", b"a file again")
    materialize_model_folder(server, "flip")
    assert (local / "data").read_bytes() == b"a file again"
    assert set(read_marker(local).fetched) == {"main.py", "data"}


def test_a_versioned_bucket_fetches_only_the_files_that_changed(s3, tmp_path, bucket_config, boto) -> None:
    # A GET in a versioned bucket answers the object's version; the listing has none.
    from nereid.storage import materialize_model_folder

    client, bucket = boto, "nereid-versioned"
    if bucket not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket=bucket)
        client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    for relative, body in [("main.py", b"print()"), ("helpers/note.txt", b"a note")]:
        client.put_object(Bucket=bucket, Key=f"{s3.prefix}/v/{relative}", Body=body)
    server = load_settings(bucket_config(tmp_path, f"s3://{bucket}/{s3.prefix}")).server

    def gets(relative: str) -> int:
        with s3.lock:
            return sum(1 for method, path, _ in s3.requests
                       if method == "GET" and path == f"/{bucket}/{s3.prefix}/v/{relative}")

    local = materialize_model_folder(server, "v")
    assert (gets("main.py"), gets("helpers/note.txt")) == (1, 1)
    client.put_object(Bucket=bucket, Key=f"{s3.prefix}/v/main.py", Body=b"print('new')")
    materialize_model_folder(server, "v")
    assert (local / "main.py").read_bytes() == b"print('new')"
    assert (gets("main.py"), gets("helpers/note.txt")) == (2, 1)  # the unchanged file is not fetched again


def test_a_file_name_of_up_to_255_bytes_is_fetched_and_a_longer_one_is_named(s3, tmp_path, bucket_config) -> None:
    # The temporary name a fetched file is written under must fit too (".<name>.<token>.<pid>.partial").
    from nereid.storage import materialize_model_folder

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    long_name = "d" * 251 + ".dat"  # 255 bytes: legal locally
    obstore.put(s3.store, f"{s3.prefix}/m/main.py", b"print()")
    obstore.put(s3.store, f"{s3.prefix}/m/{long_name}", b"data")
    local = materialize_model_folder(server, "m")
    assert (local / long_name).read_bytes() == b"data"
    assert not [p.name for p in local.iterdir() if p.name.endswith(".partial")]
    too_long = "e" * 252 + ".dat"
    obstore.put(s3.store, f"{s3.prefix}/m/{too_long}", b"data")
    _refused_as_too_long(lambda: materialize_model_folder(server, "m"),
                         f"{s3.url('m', too_long)}: cannot write it into")


def _refused_as_too_long(call, start: str) -> None:
    """``call`` fails with a StorageError that starts with ``start`` and names the local limit on a name's length."""
    from nereid.storage import StorageError

    with pytest.raises(StorageError) as caught:
        call()
    message = str(caught.value)
    assert message.startswith(f"{start} the local cache ("), message
    assert message.endswith(", under server.cache_dir): File name too long (a local file system allows 255 bytes "
                            "per name)")


def test_a_cached_file_changed_in_place_is_fetched_again(s3, tmp_path, bucket_config) -> None:
    # The same size, so only its modification time (recorded in the marker) tells.
    import os

    from nereid.storage import materialize_model_folder

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    obstore.put(s3.store, f"{s3.prefix}/m/main.py", b"print(1)")
    obstore.put(s3.store, f"{s3.prefix}/m/note.txt", b"a note")
    local = materialize_model_folder(server, "m")
    written = (local / "main.py").stat().st_mtime_ns
    assert read_marker(local).fetched["main.py"].mtime_ns == written
    time.sleep(0.05)  # past the file system's clock tick
    (local / "main.py").write_bytes(b"print(2)")
    assert (local / "main.py").stat().st_mtime_ns != written
    materialize_model_folder(server, "m")
    assert (local / "main.py").read_bytes() == b"print(1)"
    assert (len(s3.gets("m/main.py")), len(s3.gets("m/note.txt"))) == (2, 1)
    materialize_model_folder(server, "m")  # as written: not fetched again
    assert len(s3.gets("m/main.py")) == 2
    os.utime(local / "note.txt", ns=(written, written + 1))
    materialize_model_folder(server, "m")
    assert len(s3.gets("m/note.txt")) == 2
