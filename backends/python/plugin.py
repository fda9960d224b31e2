"""Plugin: claims folders with a ``main.py`` and runs it once per batch."""

from __future__ import annotations

import sys
from pathlib import Path

from nereid.backend import BackendClaim
from nereid.backends.subprocess.model import SubprocessModel
from nereid.errors import ConfigError
from nereid.hookspecs import hookimpl

BACKEND_NAME = "python"
ENTRY_FILE = "main.py"


class PythonModel(SubprocessModel):
    """``main.py`` run with the interpreter that runs the server."""

    platform = "nereid_python"

    def prepare(self) -> None:
        if not (self.context.folder / ENTRY_FILE).is_file():
            raise ConfigError(f"model '{self.context.name}': missing {ENTRY_FILE} in {self.context.folder}")

    def command(self) -> list[str]:
        return [sys.executable, ENTRY_FILE]


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    """Claim folders that contain ``main.py`` (or any folder declared ``backend: python``)."""
    if declared or (folder / ENTRY_FILE).is_file():
        return BackendClaim(BACKEND_NAME, PythonModel)
    return None
