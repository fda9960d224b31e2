"""Plugin: the ``cxx`` backend claims only folders declared ``backend: cxx`` in nereid.yaml.

Its folders hold just a ``model_inference.textproto``: nothing in them says
"cxx", so claiming undeclared folders would take every textproto-only folder.
"""

from __future__ import annotations

from pathlib import Path

from nereid.backend import BackendClaim
from nereid.backends.cxx.model import CxxModel
from nereid.hookspecs import hookimpl

BACKEND_NAME = "cxx"


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    """Claim the folder when nereid.yaml declares it ``backend: cxx``; decline every other."""
    return BackendClaim(BACKEND_NAME, CxxModel) if declared else None
