"""nereid: a Triton-compatible model server (KServe V2 / Open Inference Protocol over gRPC and HTTP)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("nereid")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

from nereid.model_hooks import register_model  # noqa: E402  (stdlib only: keeps `import nereid` light)

__all__ = ["__version__", "register_model"]
