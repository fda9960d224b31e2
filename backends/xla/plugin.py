"""Plugin: claims folders with a ``manifest.yaml`` (StableHLO/XLA bundles)."""

from __future__ import annotations

from pathlib import Path

from nereid.backend import BackendClaim
from nereid.backends.xla.manifest import MANIFEST_NAME, declares_meta
from nereid.backends.xla.model import create_model
from nereid.hookspecs import hookimpl

BACKEND_NAME = "xla"


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    """Claim folders that contain ``manifest.yaml`` (or any folder declared ``backend: xla``).

    A manifest saying ``meta: true`` is a meta model's (the meta backend claims it), not a bundle.
    """
    if declared:
        return BackendClaim(BACKEND_NAME, create_model)
    manifest = folder / MANIFEST_NAME
    if manifest.is_file() and not declares_meta(manifest):
        return BackendClaim(BACKEND_NAME, create_model)
    return None
