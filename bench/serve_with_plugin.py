"""Run ``nereid serve`` with the bench backends (identity, numpy layer) registered (bench use only).

``serve_with_plugin.py CONFIG HOST:PORT``: ``nereid serve --config CONFIG --bind HOST:PORT --log-level WARNING``
itself (its logging, its filters of library lines, its limits and exit), with two more backends.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import identity_backend  # noqa: E402  (found through the path above)
import layer_backend  # noqa: E402

from nereid.cli import main as nereid_main  # noqa: E402


def main() -> int:
    config, bind = sys.argv[1], sys.argv[2]
    # Through the command's own entry point, so that the log is nereid serve's: built here, the server logged
    # grpcio's ERROR and traceback for an answer to a call that had already ended (a DEBUG line under serve).
    return nereid_main(["serve", "--config", config, "--bind", bind, "--log-level", "WARNING"],
                       extra_plugins=(identity_backend, layer_backend))


if __name__ == "__main__":
    sys.exit(main())
