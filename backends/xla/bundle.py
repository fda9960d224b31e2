"""A bundle directory: which program file serves which batch size and variant, and the weights.

The files are ``model.mlir`` (one program, or one batch size), ``model.b{N}.mlir``
(one per compiled batch size), and ``model.v{i}[.b{N}].mlir`` (one set per
``input_shapes`` variant, ``i`` counting from 1 in list order). These are the
checks :func:`~.manifest.load_manifest` leaves out because they need the
directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from nereid.backends.xla.manifest import MANIFEST_NAME, Manifest, load_manifest
from nereid.errors import ConfigError, MissingModelFile
from nereid.files import not_regular_reason

MODEL_PY = "model.py"
DEFAULT_WEIGHTS_FILE = "weights.safetensors"
CACHE_DIR = ".cache"


@dataclass(frozen=True, order=True)
class ProgramKey:
    """Which compiled program: an ``input_shapes`` variant (1-based, None without
    variants) at a batch size (None for an unbatched bundle)."""

    variant: int | None
    batch_size: int | None

    def describe(self) -> str:
        """``batch size 8, variant 2``-style text for messages."""
        parts = []
        if self.batch_size is not None:
            parts.append(f"batch size {self.batch_size}")
        if self.variant is not None:
            parts.append(f"variant {self.variant}")
        return ", ".join(parts) or "the only program"


@dataclass(frozen=True)
class BundleLayout:
    """A bundle's manifest and the files it is served from.

    ``weights_path`` is None when the bundle has no weights file (a program
    without weights). ``modules`` holds the program file of every selected key.
    """

    folder: Path
    manifest: Manifest
    modules: Mapping[ProgramKey, Path]
    weights_path: Path | None
    model_py: Path | None

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes selected for serving, ascending (empty when unbatched)."""
        return tuple(sorted({k.batch_size for k in self.modules if k.batch_size is not None}))


def module_candidates(key: ProgramKey, single_size: bool) -> list[str]:
    """File names that may hold the program for ``key``, preferred first."""
    stem = "model" if key.variant is None else f"model.v{key.variant}"
    if key.batch_size is None:
        return [f"{stem}.mlir"]
    names = [f"{stem}.b{key.batch_size}.mlir"]
    if single_size:
        names.append(f"{stem}.mlir")
    return names


def program_keys(manifest: Manifest, largest_only: bool = False) -> list[ProgramKey]:
    """Every (variant, batch size) the manifest compiles; only the largest size with ``largest_only``."""
    sizes: list[int | None] = list(manifest.batching.compiled_batch_sizes) if manifest.batching else [None]
    if largest_only:
        sizes = sizes[-1:]
    variants: list[int | None] = (list(range(1, len(manifest.input_shapes) + 1))
                                  if manifest.input_shapes else [None])
    return [ProgramKey(v, s) for v in variants for s in sizes]


def not_a_folder_reason(path: Path, wanted: str = "a bundle's folder, or a folder of bundles") -> str | None:
    """Why ``path`` cannot be a bundle (or a folder of bundles: ``wanted`` says which a command takes): it is
    missing, or not a folder; None if it is a folder."""
    if path.is_dir():
        return None
    if not os.path.lexists(path):
        return "no such file or folder"
    if not path.exists():
        return f"is a symlink to {os.readlink(path)}, which does not exist"
    if path.name == MANIFEST_NAME:
        return f"is a file, not a folder: name the bundle's folder ({path.parent}), not its {MANIFEST_NAME}"
    return f"is a file, not a folder: name {wanted}"


def require_manifest(folder: Path) -> Path:
    """``folder``'s manifest path; ConfigError when it has no manifest that is a regular file (it is no bundle)."""
    manifest_path = folder / MANIFEST_NAME
    if (reason := not_regular_reason(manifest_path)) is not None:
        raise ConfigError(reason)
    if not manifest_path.is_file():
        raise MissingModelFile(f"{folder}: missing {MANIFEST_NAME} (a bundle holds {MANIFEST_NAME}, model*.mlir "
                               "and usually weights.safetensors)")
    return manifest_path


def open_bundle(folder: Path, largest_only: bool = False, weights_elsewhere: bool = False) -> BundleLayout:
    """Read the manifest and find every file the bundle is served from.

    ``largest_only`` selects only the largest compiled batch size (the
    ``runtime.batch_sizes: largest`` option), whose program file alone is then
    required. ``weights_elsewhere``: the weights files are not in the folder
    (they stream from an object store), so ``weights_path`` is None. Raises
    ConfigError naming the manifest key or the missing file.
    """
    folder = Path(folder)
    manifest_path = require_manifest(folder)
    manifest = load_manifest(manifest_path)
    model_py = folder / MODEL_PY
    if (reason := not_regular_reason(model_py)) is not None:
        # A folder named model.py is a mistake to report, not a bundle without hooks to serve without them.
        raise ConfigError(f"{reason} (a bundle's {MODEL_PY} holds its hooks)")
    has_model_py = model_py.is_file()
    if manifest.has_client_specs and not has_model_py:
        key = "client_inputs" if manifest.client_inputs is not None else "client_outputs"
        names = [t.name for t in getattr(manifest, key)]
        raise ConfigError(f"{manifest_path}: {key}: allowed only in a bundle with a {MODEL_PY} that transforms "
                          f"between client and executable tensors (add {MODEL_PY} or remove the key), "
                          f"got tensors {names}")
    single_size = manifest.batching is None or len(manifest.batching.compiled_batch_sizes) == 1
    modules: dict[ProgramKey, Path] = {}
    for key in program_keys(manifest, largest_only):
        candidates = module_candidates(key, single_size)
        found = None
        for path in (folder / name for name in candidates):
            # Present but not a file (a FIFO, a folder): say so, rather than "missing" or falling back to
            # model.mlir when model.b8.mlir is a FIFO.
            if (reason := not_regular_reason(path)) is not None:
                raise ConfigError(f"{reason} (the program for {key.describe()})")
            if path.is_file():
                found = path
                break
        if found is None:
            present = sorted(p.name for p in folder.glob("model*.mlir"))
            raise ConfigError(f"{folder}: missing {' or '.join(candidates)}, the program for {key.describe()} "
                              f"(program files present: {', '.join(present) or 'none'})")
        modules[key] = found
    weights_path = None if weights_elsewhere else _weights_path(folder, manifest, manifest_path)
    return BundleLayout(folder, manifest, modules, weights_path, model_py if has_model_py else None)


def _weights_path(folder: Path, manifest: Manifest, manifest_path: Path) -> Path | None:
    if manifest.weights_file is not None:
        path = folder / manifest.weights_file
        if (reason := not_regular_reason(path)) is not None:
            raise ConfigError(f"{manifest_path}: weights_file: {reason}")
        if not path.is_file():
            raise ConfigError(f"{manifest_path}: weights_file: no such file {path}, got {manifest.weights_file!r}")
        return path
    path = folder / DEFAULT_WEIGHTS_FILE
    if (reason := not_regular_reason(path)) is not None:
        raise ConfigError(reason)
    return path if path.is_file() else None
