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
