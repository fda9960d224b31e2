"""Run ``nereid serve`` with the bench backends (identity, numpy layer) registered (bench use only)."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import identity_backend  # noqa: E402  (found through the path above)
import layer_backend  # noqa: E402

from nereid.plugins import make_plugin_manager  # noqa: E402
from nereid.server import NereidServer  # noqa: E402
from nereid.settings import load_settings  # noqa: E402


def main() -> None:
    config, bind = Path(sys.argv[1]), sys.argv[2]
    logging.basicConfig(level=logging.WARNING)
    manager = make_plugin_manager(extra_plugins=(identity_backend, layer_backend))
    asyncio.run(NereidServer(load_settings(config), manager=manager, bind_addr=bind).serve_until_signalled())


if __name__ == "__main__":
    main()
