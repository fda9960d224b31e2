"""parse_options: the xla backend's ``runtime:`` options, their defaults, and a mistake named by key and value."""

from __future__ import annotations

import pytest

from nereid.backends.xla.options import XlaOptions, parse_options
from nereid.errors import ConfigError


def test_no_options_are_the_documented_defaults() -> None:
    assert parse_options({}, "models[0]") == XlaOptions(
        largest_batch_only=False, executable_cache=True, weights_read_threads=8, weights_migration="off",
        weights_chunk_bytes=16 * 1024 * 1024, weights_concurrency=32, weights_read_retries=3)


def test_every_option_is_read() -> None:
    options = parse_options({"batch_sizes": "largest", "executable_cache": False, "weights_read_threads": 2,
                             "weights_migration": "replace", "weights_chunk_bytes": 1024, "weights_concurrency": 4,
                             "weights_read_retries": 0}, "models[0]")
    assert options == XlaOptions(True, False, 2, "replace", 1024, 4, 0)


def test_a_bare_yaml_off_is_the_off_migration() -> None:
    """YAML reads ``weights_migration: off`` as false."""
    assert parse_options({"weights_migration": False}, "models[0]").weights_migration == "off"


@pytest.mark.parametrize("runtime, problem", [
    ({"batch_sizes": "smallest"}, "models[3].runtime.batch_sizes: must be one of all, largest, got 'smallest'"),
    ({"weights_migration": "y"}, "models[3].runtime.weights_migration: must be one of off, copy, replace, got 'y'"),
    ({"weights_migration": True}, "models[3].runtime.weights_migration: must be one of off, copy, replace, got true"),
    ({"executable_cache": "yes"}, "models[3].runtime.executable_cache: must be true or false, got 'yes'"),
    ({"weights_read_threads": 0}, "models[3].runtime.weights_read_threads: must be an integer >= 1, got 0"),
    ({"weights_chunk_bytes": "big"}, "models[3].runtime.weights_chunk_bytes: must be an integer >= 1, got 'big'"),
    ({"weights_concurrency": 0}, "models[3].runtime.weights_concurrency: must be an integer >= 1, got 0"),
    # Retries may be 0 (one try only), not fewer.
    ({"weights_read_retries": -1}, "models[3].runtime.weights_read_retries: must be an integer >= 0, got -1"),
    ({"compile_everything": True}, "models[3].runtime.compile_everything: unknown option of the xla backend "
                                   "(allowed: batch_sizes, executable_cache, weights_chunk_bytes, "
                                   "weights_concurrency, weights_migration, weights_read_retries, "
                                   "weights_read_threads), got true"),
], ids=lambda value: next(iter(value)) if isinstance(value, dict) else None)
def test_each_mistake_names_the_key_and_the_value(runtime, problem) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_options(runtime, "models[3]")
    assert str(caught.value) == problem
