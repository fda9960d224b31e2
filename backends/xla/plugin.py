"""Plugin: claims folders with a ``manifest.yaml`` (StableHLO/XLA bundles)."""

from __future__ import annotations

from pathlib import Path

from nereid.backend import BackendClaim
from nereid.backends.xla.manifest import MANIFEST_NAME
from nereid.backends.xla.model import create_model
from nereid.hookspecs import hookimpl

BACKEND_NAME = "xla"


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    """Claim folders that contain ``manifest.yaml`` (or any folder declared ``backend: xla``)."""
    if declared or (folder / MANIFEST_NAME).is_file():
        return BackendClaim(BACKEND_NAME, create_model)
    return None
