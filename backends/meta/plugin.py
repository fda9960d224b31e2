"""Plugin: claims folders whose ``manifest.yaml`` says ``meta: true`` (meta models)."""

from __future__ import annotations

from pathlib import Path

from nereid.backend import BackendClaim
from nereid.backends.meta.model import MetaModel
from nereid.backends.xla.manifest import MANIFEST_NAME, declares_meta
from nereid.hookspecs import hookimpl
from nereid.runtime_options import defaults_options

BACKEND_NAME = "meta"


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    """Claim folders whose manifest says ``meta: true`` (or any folder declared ``backend: meta``).

    The xla backend declines exactly these folders, so a manifest is claimed once.
    """
    manifest = folder / MANIFEST_NAME
    if declared or (manifest.is_file() and declares_meta(manifest)):
        return BackendClaim(MetaModel)
    return None


@hookimpl
def nereid_claim_signs() -> str:
    """What makes this backend claim a folder, for the reason of a folder no backend claimed."""
    return "manifest.yaml with meta: true"


@hookimpl
def nereid_check_defaults(defaults: dict, origin: str) -> None:
    """The meta backend has no runtime options: any key in nereid.yaml's ``backends.meta`` is refused."""
    defaults_options(defaults, origin, BACKEND_NAME, ())
