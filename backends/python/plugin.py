"""Plugin: claims folders with a ``main.py`` and runs it once per batch."""

from __future__ import annotations

import sys
from pathlib import Path

from nereid.backend import BackendClaim
from nereid.backends.subprocess.model import SubprocessModel
from nereid.hookspecs import hookimpl

BACKEND_NAME = "python"
ENTRY_FILE = "main.py"


class PythonModel(SubprocessModel):
    """``main.py`` run with the interpreter that runs the server."""

    platform = "nereid_python"
    entry_file = ENTRY_FILE

    def command(self) -> list[str]:
        return [sys.executable, ENTRY_FILE]


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    """Claim folders that contain ``main.py`` (or any folder declared ``backend: python``)."""
    if declared or (folder / ENTRY_FILE).is_file():
        return BackendClaim(BACKEND_NAME, PythonModel)
    return None
