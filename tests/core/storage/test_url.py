"""Object-store URLs (``nereid.storage.url``): how ``s3://``, ``gs://`` and ``az://`` locations are read and refused."""

from __future__ import annotations

import pytest

from nereid.errors import ConfigError
from nereid.settings import load_settings
from nereid.storage import StoreURL, parse_store_url


@pytest.mark.parametrize("text, expected", [
    ("s3://bucket/a/b/", StoreURL("s3", "bucket", "a/b")),
    ("s3://bucket", StoreURL("s3", "bucket", "")),
    ("gs://bucket/models", StoreURL("gs", "bucket", "models")),
    ("az://container//x/y", StoreURL("az", "container", "x/y")),
    ("ml-backends", None),
    ("/srv/models", None),
])
def test_urls_parse_the_same_way_for_every_scheme(text, expected) -> None:
    assert parse_store_url(text) == expected
    if expected is not None:
        assert str(expected.child("m", "weights.safetensors")).startswith(f"{expected.scheme}://{expected.bucket}/")


@pytest.mark.parametrize("text, problem", [
    ("ftp://host/x", "unknown scheme 'ftp'"),
    ("s3:///prefix", "names no bucket"),
    ("s3://bucket/a/../b", "'..'"),
])
def test_bad_urls_are_refused_in_settings_with_the_key(tmp_path, text, problem) -> None:
    config = tmp_path / "nereid.yaml"
    config.write_text(f'server:\n  ml_backends_path: "{text}"\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    assert "server.ml_backends_path" in str(caught.value) and problem in str(caught.value)


@pytest.mark.parametrize("text, problem", [
    ("s3://bucket/a/./b", "must not hold '.' or '..' path segments"),
    ("s3://bucket/models?versionId=3", "is not a URL of the form <scheme>://<bucket>/<prefix>"),
    ("gs://bucket/models#top", "is not a URL of the form <scheme>://<bucket>/<prefix>"),
    ("gs://", "names no bucket"),
    ("http://host/models", "has an unknown scheme 'http' (expected a local folder or one of s3://, gs://, az://)"),
    # (The secrets hunt: the credentials were dropped unsaid, and the URL, secret included, shown to every client.)
    ("s3://AKIAX:s3cr3t@models/prod", "holds a user name, a password or a port with its bucket "
     "('user:password@bucket', 'bucket:443'); a store's credentials go in its environment variables "
     "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, GOOGLE_SERVICE_ACCOUNT, AZURE_STORAGE_ACCOUNT_KEY...), its "
     "address in its endpoint's (AWS_ENDPOINT_URL...)"),
    ("gs://models:443/prod", "holds a user name, a password or a port with its bucket"),
])
def test_a_url_that_names_no_place_in_a_store_is_refused_saying_why(text, problem) -> None:
    # (The settings put "server.ml_backends_path" and the text before these words: see the test above.)
    with pytest.raises(ValueError) as refused:
        parse_store_url(text)
    assert str(refused.value).startswith(problem) and "s3cr3t" not in str(refused.value)


def test_keys_and_children_are_the_prefix_and_parts_joined_by_one_slash() -> None:
    location = StoreURL("s3", "models", "prod/v2")
    assert location.bucket_url == "s3://models"
    assert location.key() == "prod/v2"
    assert location.key("m", "/sub/", "w.bin") == "prod/v2/m/sub/w.bin"  # (each part's own slashes dropped)
    assert location.child("m") == StoreURL("s3", "models", "prod/v2/m")
    assert str(location.child("m", "main.py")) == "s3://models/prod/v2/m/main.py"
    top = StoreURL("az", "container")
    assert (top.key("m"), str(top), str(top.child("m"))) == ("m", "az://container", "az://container/m")


def test_a_cache_name_is_readable_and_apart_for_every_location_and_endpoint() -> None:
    location = StoreURL("s3", "models", "prod/v2")
    name = location.cache_name()
    assert name.startswith("s3-models-prod_v2-") and name == location.cache_name()  # the same every time
    names = {name, location.cache_name("http://minio:9000"), StoreURL("gs", "models", "prod/v2").cache_name(),
             StoreURL("s3", "models", "prod_v2").cache_name()}  # ('/' and '_' read alike, the hash tells them apart)
    assert len(names) == 4
    long = StoreURL("s3", "b", "x" * 300).cache_name()
    assert len(long) == 80 + 1 + 12 and long.startswith("s3-b-xxx")  # within one local file name's 255 bytes
    assert StoreURL("az", "c", "a b/é").cache_name().startswith("az-c-a_b_-")  # only [A-Za-z0-9._-]
