"""Regenerate nereid's protobuf modules from ``protos/``.

Only message code is generated: the gRPC service is registered by hand under
its wire name (see protos/grpc_service.proto for why).

Run from the repository root::

    python -m nereid._proto.regenerate

The ``-Inereid/_proto=protos`` mapping makes protoc emit imports of the form
``from nereid._proto import x_pb2``, so the generated files need no patching.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_FILES = ("model_config.proto", "grpc_service.proto", "model_inference.proto")


def regenerate(repo_root: Path) -> list[Path]:
    """Compile every file in ``PROTO_FILES`` and copy the output next to this module."""
    from grpc_tools import protoc  # a development dependency, imported only here

    target = Path(__file__).resolve().parent
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as out:
        for name in PROTO_FILES:
            args = [
                "grpc_tools.protoc",
                "-Inereid/_proto=" + str(repo_root / "protos"),
                "--python_out=" + out,
                "--pyi_out=" + out,
                "nereid/_proto/" + name,
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {name}")
        for generated in sorted((Path(out) / "nereid" / "_proto").iterdir()):
            shutil.copy(generated, target / generated.name)
            written.append(target / generated.name)
    return written


def main() -> int:
    """Entry point for ``python -m nereid._proto.regenerate``."""
    for path in regenerate(Path.cwd()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
