"""Plugin: claims folders with a ``main.cpp``; compiles it at load, runs the binary per batch."""

from __future__ import annotations

from pathlib import Path

from nereid.backend import BackendClaim
from nereid.backends.cpp.compiler import build_binary
from nereid.backends.subprocess.model import SubprocessModel
from nereid.hookspecs import hookimpl

BACKEND_NAME = "cpp"
SOURCE_FILE = "main.cpp"


class CppModel(SubprocessModel):
    """A compiled ``main.cpp`` speaking the subprocess tensor contract."""

    platform = "nereid_cpp"
    entry_file = SOURCE_FILE
    _binary: Path | None = None

    def prepare(self) -> None:
        self._binary = build_binary(self.context.folder, SOURCE_FILE)

    def prepare_relocated(self) -> None:
        # The binary lives in the folder's .cache/: found again there (a copy without it compiles).
        self.prepare()

    def command(self) -> list[str]:
        assert self._binary is not None, "load() first"
        return [str(self._binary)]


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    """Claim folders that contain ``main.cpp`` (or any folder declared ``backend: cpp``)."""
    if declared or (folder / SOURCE_FILE).is_file():
        return BackendClaim(CppModel)
    return None
