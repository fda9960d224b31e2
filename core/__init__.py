"""nereid: a Triton-compatible model server (KServe V2 / Open Inference Protocol over gRPC and HTTP)."""

from __future__ import annotations

import typing

if typing.TYPE_CHECKING:
    from nereid.model_hooks import register_model

__all__ = ["__version__", "register_model"]


def __dir__() -> list[str]:
    """What the package offers, before its first use too (``dir(nereid)``, an editor's completion)."""
    return sorted({*__all__, *globals()} - {"typing", "annotations"})


def __getattr__(name: str) -> typing.Any:
    """``register_model`` and ``__version__``, looked up on first use (PEP 562) rather than when the package is
    imported: the console script (:mod:`nereid.entry`) records stop signals once ``import nereid`` has run, and
    these two, importing asyncio and importlib.metadata, had doubled Python's own start before it (the hunt of
    the console script's fix: a SIGTERM in that window, to a container's PID 1, was dropped)."""
    if name == "register_model":
        from nereid.model_hooks import register_model
        globals()[name] = register_model  # (looked up once)
        return register_model
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version
        try:
            found = version("nereid")
        except PackageNotFoundError:  # running from a source tree that was never installed
            found = "0.0.0"
        globals()[name] = found
        return found
    raise AttributeError(f"module 'nereid' has no attribute {name!r}")
