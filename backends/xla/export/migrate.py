"""Offline weights migration, for bundles the server cannot write or to convert ahead of a deploy.

    python -m nereid.backends.xla.export.migrate [--mode copy|replace] BUNDLE...

The same migration as ``runtime.weights_migration`` (see
:mod:`nereid.backends.xla.migration`): legacy weights rewritten in the
program's axis order, proved byte for byte, crash-safe. Prints one line per
bundle; exits 1 if any could not be migrated.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nereid.backends.xla.migration import failure_reason, migrate_bundle
from nereid.leftovers import remove_model_leftovers


def main(argv: list[str] | None = None) -> int:
    """Migrate each bundle named on the command line."""
    parser = argparse.ArgumentParser(prog="python -m nereid.backends.xla.export.migrate",
                                     description=(__doc__ or "").split("\n")[0])  # (python -OO: no __doc__)
    parser.add_argument("--mode", choices=("copy", "replace"), default="copy",
                        help="copy: add weights.T.safetensors (default); replace: swap it in")
    parser.add_argument("bundles", nargs="+", type=Path, metavar="BUNDLE")
    args = parser.parse_args(argv)
    failures = 0
    for bundle in args.bundles:
        try:
            # A migrate killed earlier left a weights-sized temporary file, which only a server's load removed: a
            # bundle migrated ahead of a deploy shipped it (the exporter hunt). Removed as a load removes it.
            remove_model_leftovers(bundle)
            outcome = migrate_bundle(bundle, args.mode)
        except Exception as err:  # an unforeseen failure too is this bundle's line: the bundles after it still run
            failures += 1
            print(f"{bundle}: FAILED: {failure_reason(err)}")
            continue
        print(f"{bundle}: {outcome.what}")
        failures += outcome.blocked  # (not migrated, for a reason the user must act on: a file of theirs in the way)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
