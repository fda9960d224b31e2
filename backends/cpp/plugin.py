"""Plugin: claims folders with a ``main.cpp``; compiles it at load, runs the binary per batch."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from nereid.backend import BackendClaim
from nereid.backends.cpp.compiler import build_binary
from nereid.backends.scratch import require_executable_folder, scratch_folder_refused
from nereid.backends.subprocess.model import SubprocessModel
from nereid.errors import ModelFailure
from nereid.hookspecs import hookimpl
from nereid.leftovers import make_private_folder
from nereid.runtime_options import defaults_options

BACKEND_NAME = "cpp"
SOURCE_FILE = "main.cpp"


class CppModel(SubprocessModel):
    """A compiled ``main.cpp`` speaking the subprocess tensor contract."""

    platform = "nereid_cpp"
    backend_name = BACKEND_NAME  # no runtime options: SubprocessModel.check_options refuses every key
    entry_file = SOURCE_FILE
    _binary: Path | None = None
    _built: Path | None = None

    def prepare(self) -> None:
        # Before the compile: the binary runs from the scratch folder (its link below, or a build made there
        # when .cache/ cannot be written), which a noexec /tmp would let load and then fail every request.
        require_executable_folder(self.context.name, self.context.scratch_dir, "its binary runs from")
        self._built = build_binary(self.context.folder, SOURCE_FILE, self.context.scratch_dir, self.context.name,
                                   self.context.abandoned)
        self._binary = self._own_link(self._built)

    def _own_link(self, built: Path) -> Path:
        """This version's own link to (or copy of) ``built``, in a folder of its own in the scratch folder.

        Runs use it: the next version's build removes stale binaries from
        .cache/ while this one still serves, and the folder may be renamed or
        deleted while requests are queued. ConfigError naming the scratch
        folder when it cannot be made (a full disk); nothing is left behind
        then, since a failed load is never unloaded (SubprocessModel.load lets
        only the folder go, not this version's files).
        """
        scratch = self.context.scratch_dir
        run_dir: Path | None = None
        try:
            run_dir = Path(tempfile.mkdtemp(prefix="cpp-", dir=scratch))
            binary = run_dir / built.name
            try:
                os.link(built, binary)
            except OSError:  # another file system, or no hard links there
                shutil.copy2(built, binary)
            return binary
        except BaseException as err:
            if run_dir is not None:
                shutil.rmtree(run_dir, ignore_errors=True)  # with a half-written copy
            if isinstance(err, OSError):
                raise scratch_folder_refused(self.context.name, f"put its binary {built} into", scratch, err) \
                    from None
            raise

    def prepare_relocated(self) -> None:
        """Nothing to find again: the binary is this version's own link, outside the folder."""

    def command(self) -> list[str]:
        assert self._binary is not None and self._built is not None, "load() first"
        if not self._binary.exists():
            # The server's scratch folder was removed under it (a /tmp cleaner): link this version's binary
            # again from .cache/, where a build's name is its sources' hash, so the same name is the same build.
            # No copy here: a file being written while other runs fork is held open for writing by their
            # children until they exec, and executing it then fails (ETXTBSY). On another file system the
            # build runs from where it is.
            if not self._built.exists():
                raise ModelFailure(f"model '{self.context.name}': its binary was removed with the server's scratch "
                                   f"folder, and its build {self._built} is gone too, so it cannot be linked again; "
                                   "reload the model")
            make_private_folder(self._binary.parent)
            try:
                os.link(self._built, self._binary)
            except FileExistsError:  # (a concurrent run linked it first)
                pass
            except OSError:  # another file system, or no hard links there
                return [str(self._built)]
        return [str(self._binary)]

    def unload(self) -> None:
        """Remove this version's link to the binary (the compiled one stays in .cache/)."""
        if self._binary is not None:
            shutil.rmtree(self._binary.parent, ignore_errors=True)
        super().unload()


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    """Claim folders that contain ``main.cpp`` (or any folder declared ``backend: cpp``)."""
    # Present in any form: a FIFO or a folder named main.cpp is then reported as such by the load.
    if declared or os.path.lexists(folder / SOURCE_FILE):
        return BackendClaim(CppModel)
    return None


@hookimpl
def nereid_claim_signs() -> str:
    """What makes this backend claim a folder, for the reason of a folder no backend claimed."""
    return "main.cpp"


@hookimpl
def nereid_check_defaults(defaults: dict, origin: str) -> None:
    """The cpp backend has no runtime options: any key in nereid.yaml's ``backends.cpp`` is refused."""
    defaults_options(defaults, origin, BACKEND_NAME, ())
