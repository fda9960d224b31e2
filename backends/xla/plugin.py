"""Plugin: claims folders with a ``manifest.yaml`` (StableHLO/XLA bundles), and streams their weights from a store."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

from nereid import python_source
from nereid.backend import BackendClaim
from nereid.backends.xla.bundle import not_a_folder_reason
from nereid.backends.xla.manifest import MANIFEST_NAME, declares_meta, text_declares_meta
from nereid.backends.xla.model import create_model
from nereid.backends.xla.options import XlaOptions, parse_options
from nereid.backends.xla.weights import WEIGHTS_SUFFIX
from nereid.hookspecs import hookimpl
from nereid.runtime_options import LayeredRuntime

BACKEND_NAME = "xla"


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    """Claim folders that contain ``manifest.yaml`` (or any folder declared ``backend: xla``).

    A manifest saying ``meta: true`` is a meta model's (the meta backend claims it), not a bundle.
    """
    if declared or has_bundle_manifest(folder):
        return BackendClaim(create_model)
    return None


@hookimpl
def nereid_claim_signs() -> str:
    """What makes this backend claim a folder, for the reason of a folder no backend claimed."""
    return "manifest.yaml"


def has_bundle_manifest(folder: Path) -> bool:
    """Whether ``folder`` holds a ``manifest.yaml`` of any kind that is not a meta model's.

    A FIFO, a folder or a dangling link named ``manifest.yaml`` still says the folder is meant as a
    bundle: claimed, its load names what is wrong with the file ("is a FIFO, not a regular file"),
    where declining would leave only "no backend claims the folder". Nothing here opens a FIFO:
    :func:`declares_meta` reads without blocking and answers False for anything but a regular file.
    """
    manifest = folder / MANIFEST_NAME
    return os.path.lexists(manifest) and not declares_meta(manifest)


@hookimpl
def nereid_streamed_files(name: str, declared: bool, listing: tuple[str, ...],
                          read_small: Callable[[str], bytes | None]) -> tuple[str, ...] | None:
    """A bundle's weights in an object store stay there: every listed ``*.safetensors`` (shards, in subfolders
    too), read by ranged GETs at load (:class:`~nereid.backends.xla.remote.RemoteBundle`). A weights file named
    otherwise (``weights_file: weights.bin``) is fetched with the other files, and read as a local one.

    A bundle is a folder whose ``manifest.yaml`` is not a meta model's (``meta: true``: the meta backend's
    model.py reads its own files from disk), as :func:`has_bundle_manifest` tells a local one; declared or
    not, the same (a meta manifest declared ``backend: xla`` fails its load, whatever was fetched).
    """
    if MANIFEST_NAME not in listing or text_declares_meta(read_small(MANIFEST_NAME)):
        return None
    return tuple(path for path in listing if path.endswith(WEIGHTS_SUFFIX))


@hookimpl
def nereid_add_commands(commands: Any) -> None:
    """``nereid bundle check DIR...``: whether each bundle's programs take inputs + weights arguments, of the
    types its manifest and weights declare."""
    bundle = commands.add_parser("bundle", help="StableHLO/XLA bundle tools")
    bundle_commands = bundle.add_subparsers(dest="bundle_command", required=True)
    check = bundle_commands.add_parser(
        "check", help="report whether each bundle's programs take inputs + weights arguments of the declared types")
    check.add_argument("dirs", nargs="+", type=Path, metavar="DIR",
                       help="a bundle, or a folder whose sub-folders are bundles")
    check.set_defaults(run=lambda args: check_bundles(args.dirs))


HOOKS_FILE = "model.py"


def _hooks_problem(bundle: Path) -> str | None:
    """Why the bundle's ``model.py`` cannot load, as far as compiling it tells (not running it: running a
    bundle's own code is ``nereid check``'s, which loads the model); None when it compiles, or there is none."""
    hooks = bundle / HOOKS_FILE
    if not os.path.lexists(hooks):
        return None
    try:
        compile(hooks.read_bytes(), str(hooks), "exec")
    except SyntaxError as err:
        return f"{HOOKS_FILE}: not valid Python ({python_source.syntax_error_text(err)})"
    except (OSError, ValueError) as err:  # unreadable, a folder, NUL bytes
        return f"{HOOKS_FILE}: cannot be read as Python ({err})"
    return None


def check_bundles(dirs: list[Path]) -> int:
    """Print one arity report line per bundle (never raising); 1 if any is unservable, 2 if a path named is
    not a folder (said on stderr; the others are still checked).

    A bundle whose arity is right is also put through the program type check
    the server's load runs: one that passes the arity report but never loads
    (a wrong dim or dtype in the manifest, a wrong weight) is UNSERVABLE here too.
    """
    from nereid.backends.xla.arity import check_bundle

    bundles: list[Path] = []
    not_folders = 0
    for directory in dirs:
        if (problem := not_a_folder_reason(directory)) is not None:
            # Checked as a bundle, a mistyped path was only "UNSERVABLE: missing manifest.yaml".
            print(f"error: {directory}: {problem}", file=sys.stderr)
            not_folders += 1
        elif (directory / MANIFEST_NAME).is_file() and declares_meta(directory / MANIFEST_NAME):
            # Named on its own, a meta model is said to be one, neither checked nor counted: its manifest
            # describes no program (nereid check loads it), and it is not an unservable bundle.
            print(f"{directory}: skipped: a meta model (meta: true in {MANIFEST_NAME}) runs no program of its "
                  "own; nereid check loads it")
        elif directory.is_dir() and not os.path.lexists(directory / MANIFEST_NAME):
            # A meta model's manifest (meta: true) describes no program: it is not a bundle to check. A
            # manifest that is not a regular file (a FIFO) is a bundle's, reported with what is wrong.
            manifested = sorted(p for p in directory.iterdir() if p.is_dir() and (
                os.path.lexists(p / MANIFEST_NAME) or any(p.glob("*.mlir"))))
            # No manifest inside at all: report the folder itself ("missing manifest.yaml"). Only meta models
            # inside: nothing to check, which is no unservable bundle either. A folder holding a program but no
            # manifest is a broken bundle (its manifest lost): reported, where a scan once skipped it unsaid.
            bundles.extend([p for p in manifested if has_bundle_manifest(p) or not os.path.lexists(p / MANIFEST_NAME)]
                           if manifested else [directory])
        else:
            bundles.append(directory)
    unservable = 0
    # (A bundle servable elsewhere loads nowhere under XLA_FLAGS XLA refuses: the server refuses every one so.)
    environment = _xla_flags_problem() if bundles else None
    for path in bundles:
        report, problem = check_bundle(path)
        problem = problem or (_hooks_problem(path) if report.servable else None)
        if report.servable and problem is None and environment is not None:
            problem = f"not here: {environment}"  # (the bundle itself is right)
        unservable += not report.servable or problem is not None
        line = report.line() if problem is None else f"{path}: UNSERVABLE: {problem}"
        if report.servable and problem is None and os.path.lexists(path / HOOKS_FILE):  # (said of servable ones only)
            line += f" ({HOOKS_FILE} compiled, not run: nereid check loads it)"
        print(line)
    print(f"{len(bundles)} bundle(s), {unservable} unservable")
    return 2 if not_folders else 1 if unservable else 0


def _xla_flags_problem() -> str | None:
    """Why XLA refuses this environment's XLA_FLAGS, as a server's load would say it; None when it does not (or
    jax is not installed: nothing here starts it then)."""
    try:
        from nereid.backends.xla.device import xla_flags_problem
    except ImportError:
        return None
    return xla_flags_problem()


@hookimpl
def nereid_check_defaults(defaults: dict, origin: str) -> None:
    """Refuse a mistake in nereid.yaml's ``backends.xla`` (``batch_sizes: smallest``), served model or not."""
    parse_options(LayeredRuntime({}, defaults, origin), origin)


@hookimpl
def nereid_model_options(name: str, folder: Path, runtime: dict, origin: str) -> XlaOptions:
    """The options a bundle loads with: an edit of ``backends.xla`` that leaves them as they are
    (``batch_sizes: all`` written out) reloads no bundle."""
    return parse_options(runtime, origin)
