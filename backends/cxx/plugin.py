"""Plugin: the ``cxx`` backend claims only folders declared ``backend: cxx`` in nereid.yaml.

Its folders hold just a ``model_inference.textproto``: nothing in them says
"cxx", so claiming undeclared folders would take every textproto-only folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nereid.backend import BackendClaim
from nereid.backends.cxx.build import header_path
from nereid.backends.cxx.model import CxxModel
from nereid.backends.cxx.options import ALLOWED_KEYS, CxxOptions, parse_options
from nereid.hookspecs import hookimpl
from nereid.runtime_options import defaults_options
from nereid.signature import TEXTPROTO_NAME

BACKEND_NAME = "cxx"


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    """Claim the folder when nereid.yaml declares it ``backend: cxx``; decline every other."""
    return BackendClaim(CxxModel) if declared else None


@hookimpl
def nereid_claim_signs() -> str:
    """What makes this backend claim a folder, for the reason of a folder no backend claimed."""
    return "only when declared"


@hookimpl
def nereid_declaration_hint(folder: Path, config_name: str) -> str | None:
    """A folder holding a textproto and, besides, only C or C++ sources or shared libraries looks like a cxx model
    (the shipped cxx_scale holds its textproto and scale.cpp: the error hunt found the hint kept from it)."""
    try:
        visible = [p.name for p in folder.iterdir() if not p.name.startswith(".")]
    except OSError:  # gone (or unreadable) meanwhile: nothing to hint at; the load says what is wrong
        return None
    if TEXTPROTO_NAME not in visible:
        return None
    native = [name for name in visible if name != TEXTPROTO_NAME]
    if not all(Path(name).suffix in NATIVE_FILE_SUFFIXES or ".so." in name for name in native):
        return None
    # Only "may be": a python or cpp model whose main file is not written yet looks the same.
    held = f"only {TEXTPROTO_NAME}" if not native else f"{TEXTPROTO_NAME} and C or C++ code"
    return (f"if it is a cxx model (a folder holding {held} may be one), declare it in "
            f"{config_name} with backend: cxx and runtime: {{library: PATH}} (or runtime: {{sources: [...]}})")


# What a cxx model's folder holds beside its textproto: the sources it is compiled from, or the library.
NATIVE_FILE_SUFFIXES = frozenset({".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".hxx", ".so"})


@hookimpl
def nereid_add_commands(commands: Any) -> None:
    """``nereid cxx-header``: print where the cxx backend's C header is installed."""
    command = commands.add_parser("cxx-header", help="print the path of nereid_cxx.h, the C header of the cxx backend")
    command.set_defaults(run=lambda args: print(header_path()) or 0)


@hookimpl
def nereid_check_defaults(defaults: dict, origin: str) -> None:
    """Refuse an unknown key in nereid.yaml's ``backends.cxx``, served model or not (a library or sources there
    are read, against each model's folder, when a model loads)."""
    defaults_options(defaults, origin, BACKEND_NAME, ALLOWED_KEYS)


@hookimpl
def nereid_model_options(name: str, folder: Path, runtime: dict, origin: str) -> CxxOptions:
    """The library (or sources) a cxx model loads, its paths resolved: an edit of ``backends.cxx`` that a model's
    own ``library`` or ``sources`` overrides reloads no model."""
    return parse_options(name, runtime, origin, folder)
