"""Protocol-neutral errors. Each protocol edge maps them to its status codes once."""

from __future__ import annotations


class NereidError(Exception):
    """Base of every error nereid reports to a client; ``str(err)`` is the message."""


class NotFound(NereidError):
    """An unknown model (gRPC NOT_FOUND)."""


class InvalidArgument(NereidError):
    """A request that does not match the model's contract (gRPC INVALID_ARGUMENT)."""


class Unavailable(NereidError):
    """A model that is not ready, a full queue, a server shutting down (gRPC UNAVAILABLE)."""


class DeadlineExceeded(NereidError):
    """A request whose deadline passed before it could start (gRPC DEADLINE_EXCEEDED)."""


class ModelFailure(NereidError):
    """The model failed while running a request (gRPC INTERNAL)."""


class ConfigError(NereidError):
    """A mistake in nereid.yaml or a model folder, raised at load or check time."""
