"""The xla backend's ``runtime:`` options from nereid.yaml, checked once at load.

```yaml
models:
  - name: mlp_bundle
    runtime:
      batch_sizes: largest      # all (default) | largest: compile and serve only the largest size
      executable_cache: true    # default true: reuse and write <bundle>/.cache/
      weights_read_threads: 8   # parallel pread workers for the weights file (default 8)
      weights_migration: off    # off (default) | copy | replace: rewrite legacy weights in program order
      # Bundles in an object store (weights streamed with ranged GETs):
      weights_chunk_bytes: 16777216   # bytes per ranged GET (default 16 MiB)
      weights_concurrency: 32         # ranged GETs in flight (default 32)
      weights_read_retries: 3         # further tries of a failed or short range (default 3)
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from nereid.backends.xla.migration import MIGRATION_MODES
from nereid.backends.xla.safetensors import DEFAULT_CHUNK_BYTES, DEFAULT_READ_THREADS
from nereid.runtime_options import RuntimeOptions

BATCH_SIZES_CHOICES = ("all", "largest")
# Ranged GETs of a bundle in an object store: the seed's streaming loader's defaults.
DEFAULT_REMOTE_CONCURRENCY = 32
DEFAULT_REMOTE_RETRIES = 3


@dataclass(frozen=True)
class XlaOptions:
    """Parsed ``runtime:`` options of one xla model."""

    largest_batch_only: bool = False
    executable_cache: bool = True
    weights_read_threads: int = DEFAULT_READ_THREADS
    weights_migration: str = "off"
    weights_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    weights_concurrency: int = DEFAULT_REMOTE_CONCURRENCY
    weights_read_retries: int = DEFAULT_REMOTE_RETRIES


def parse_options(runtime: Mapping[str, Any], origin: str) -> XlaOptions:
    """Check ``runtime`` options; ConfigError names ``<origin>.runtime.<key>`` and the value."""
    options = RuntimeOptions(runtime, origin, "xla", ("batch_sizes", "executable_cache", "weights_read_threads",
                                                      "weights_migration", "weights_chunk_bytes",
                                                      "weights_concurrency", "weights_read_retries"))
    batch_sizes = options.get("batch_sizes", "all")
    if batch_sizes not in BATCH_SIZES_CHOICES:
        options.fail("batch_sizes", f"must be one of {', '.join(BATCH_SIZES_CHOICES)}", batch_sizes)
    migration = options.get("weights_migration", "off")
    if migration is False:  # YAML reads a bare `off` as false
        migration = "off"
    if migration not in MIGRATION_MODES:
        options.fail("weights_migration", f"must be one of {', '.join(MIGRATION_MODES)}", migration)
    return XlaOptions(batch_sizes == "largest", options.boolean("executable_cache", True),
                      options.integer("weights_read_threads", DEFAULT_READ_THREADS), migration,
                      weights_chunk_bytes=options.integer("weights_chunk_bytes", DEFAULT_CHUNK_BYTES),
                      weights_concurrency=options.integer("weights_concurrency", DEFAULT_REMOTE_CONCURRENCY),
                      weights_read_retries=options.integer("weights_read_retries", DEFAULT_REMOTE_RETRIES, 0))
