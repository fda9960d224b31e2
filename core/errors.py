"""Protocol-neutral errors. Each protocol edge maps them to its status codes once."""

from __future__ import annotations


class NereidError(Exception):
    """Base of every error nereid reports to a client; ``str(err)`` is the message.

    ``reason`` is a short label for metrics (``nereid_request_failure_total``).
    """

    reason = "internal"


class NotFound(NereidError):
    """An unknown model (gRPC NOT_FOUND)."""

    reason = "not_found"


class InvalidArgument(NereidError):
    """A request that does not match the model's contract (gRPC INVALID_ARGUMENT)."""

    reason = "invalid_argument"


class Unavailable(NereidError):
    """A model that is not ready, a full queue, a server shutting down (gRPC UNAVAILABLE)."""

    reason = "unavailable"


class QueueFull(Unavailable):
    """A request refused because the model's queue is at capacity (gRPC UNAVAILABLE)."""

    reason = "queue_full"


class DeadlineExceeded(NereidError):
    """A request whose deadline passed before it could start (gRPC DEADLINE_EXCEEDED)."""

    reason = "deadline_exceeded"


class ModelFailure(NereidError):
    """The model failed while running a request (gRPC INTERNAL)."""

    reason = "internal"


class ConfigError(NereidError):
    """A mistake in nereid.yaml or a model folder, raised at load or check time."""

    reason = "invalid_config"
