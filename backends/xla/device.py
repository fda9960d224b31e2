"""Mapping nereid's ``device`` setting to a PJRT client and device.

``cpu`` is jax's CPU client; ``cuda`` / ``cuda:<i>`` is the i-th local device of
jax's CUDA client (ordered by device id). A GPU that is not there is a load
error with the reason, so the model is UNAVAILABLE rather than silently on CPU.

jax starts every platform it has (``cpu``, and ``cuda`` where jax[cuda12] is
installed and an NVIDIA device node exists) the first time any backend is asked
for, whatever the platform asked for; a plugin that fails to start raises from
that first call only. :func:`started_backends` is that start, done once for the
process, keeping the error for the models that need the platform it cost.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from nereid.errors import ConfigError
from nereid.settings import Device

# jax registers NVIDIA GPUs as platform "cuda"; "gpu" is the generic alias.
_CUDA_PLATFORMS = ("cuda", "gpu")


@dataclass(frozen=True)
class PjrtTarget:
    """Where a model's programs compile and run: the PJRT client, one device, compile options."""

    client: Any
    device: Any
    compile_options: Any

    @property
    def platform(self) -> str:
        """The PJRT platform name (``cpu``, ``cuda``)."""
        return self.client.platform

    def describe(self) -> str:
        """``cuda:0 (NVIDIA H100)``-style text for logs."""
        return f"{self.platform}:{self.device.id} ({self.device.device_kind})"


# The first error jax raised while starting its backends in this process (None: none so far). jax raises it once,
# from whichever backend request came first (a cpu one too), then serves what did start and never mentions the
# platform that failed again: the models that wanted that platform need this text for their reason.
_start_error: str | None = None
# Concurrent loads: the one whose start fails records the error before another reads the backends.
_start_lock = threading.Lock()


def started_backends() -> tuple[dict[str, Any], str | None]:
    """jax's backends by platform, started if they were not, and the error of their start in this process.

    When a plugin fails to start (CUDA's, with a driver that does not match),
    jax has already kept the backends it started before it (``cpu`` is
    registered first), and asking again returns those: a cpu model loads
    whatever the CUDA plugin does. RuntimeError when even that fails (nothing
    started, as with ``JAX_PLATFORMS=cuda`` and a failing CUDA plugin).
    """
    from jax.extend import backend as jax_backend

    global _start_error
    with _start_lock:
        try:
            return jax_backend.backends(), _start_error
        except RuntimeError as err:
            if _start_error is None:
                _start_error = str(err)
        return jax_backend.backends(), _start_error


def _jax_platforms() -> str:
    """jax's platform list (``JAX_PLATFORMS``, or jax's jax_platforms config); empty when unset."""
    import jax

    return str(getattr(jax.config, "jax_platforms", None) or os.environ.get("JAX_PLATFORMS", "")).strip()


def _left_out_by_jax_platforms(platform: str) -> str | None:
    """Why ``platform`` did not start when JAX_PLATFORMS leaves it out; None when it is unset or lists it."""
    listed = _jax_platforms()
    if not listed:
        return None
    names = {name.strip() for name in listed.split(",")}
    if "gpu" in names:  # jax's alias for cuda, rocm and oneapi
        names.add("cuda")
    if platform in names:
        return None
    return (f"JAX_PLATFORMS={listed!r} in the server's environment leaves it out (jax starts only the platforms "
            f"listed there); add {platform} to it or unset it")


def resolve_device(device: Device, model: str, origin: str) -> PjrtTarget:
    """The PJRT client and device for ``device``; ConfigError naming the setting when unavailable."""
    import numpy as np

    try:
        from jax.extend import backend as jax_backend
    except ImportError as err:
        raise ConfigError(f"model '{model}': the xla backend needs jax, which cannot be imported ({err}); "
                          "pip install jax (jax[cuda12] for GPUs)") from None

    where = f"model '{model}': device {device} ({origin})"
    try:
        backends, start_error = started_backends()
    except RuntimeError as err:
        # Nothing started at all: the error names the platform that stopped jax's start (maybe not this one).
        raise ConfigError(f"{where}: jax could not start any backend: {err}") from None
    if device.kind == "cpu":
        client = backends.get("cpu")
        if client is None:
            why = _left_out_by_jax_platforms("cpu") or start_error or f"jax started only {sorted(backends)}"
            raise ConfigError(f"{where}: jax has no cpu backend here: {why}")
        chosen = client.local_devices()[0]
    else:
        client, failures = None, []
        for platform in _CUDA_PLATFORMS:
            try:
                client = jax_backend.get_backend(platform)
                break
            except RuntimeError as err:
                failures.append(str(err))
        if client is None:
            if (left_out := _left_out_by_jax_platforms("cuda")) is not None:
                raise ConfigError(f"{where}: jax has no CUDA GPU backend here: {left_out}, or set device: cpu")
            if start_error is not None:
                # The CUDA plugin (or one started before it, which stopped jax's start) failed: its own words
                # ("Unable to initialize backend 'cuda': ..."), not the alias lookup's "Unknown backend".
                raise ConfigError(f"{where}: jax has no CUDA GPU backend here: {start_error}")
            # failures[0] is the "cuda" lookup: it carries the error of a CUDA plugin that failed quietly.
            raise ConfigError(f"{where}: jax has no CUDA GPU backend here ({failures[0]}); install jax with CUDA "
                              "support (pip install 'jax[cuda12]') on a machine with an NVIDIA GPU, or set "
                              "device: cpu")
        devices = sorted(client.local_devices(), key=lambda d: d.id)
        if device.index >= len(devices):
            seen = ", ".join(f"cuda:{i} ({d.device_kind})" for i, d in enumerate(devices))
            raise ConfigError(f"{where}: jax sees {len(devices)} GPU(s){': ' + seen if seen else ''}")
        chosen = devices[device.index]
    options = jax_backend.get_compile_options(num_replicas=1, num_partitions=1,
                                              device_assignment=np.array([[chosen.id]]), backend=client)
    return PjrtTarget(client, chosen, options)
