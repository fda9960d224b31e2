"""Mapping nereid's ``device`` setting to a PJRT client and device.

``cpu`` is jax's CPU client; ``cuda`` / ``cuda:<i>`` is the i-th local device of
jax's CUDA client (ordered by device id). A GPU that is not there is a load
error with the reason, so the model is UNAVAILABLE rather than silently on CPU.
"""

from __future__ import annotations

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


def resolve_device(device: Device, model: str, origin: str) -> PjrtTarget:
    """The PJRT client and device for ``device``; ConfigError naming the setting when unavailable."""
    import numpy as np

    try:
        from jax.extend import backend as jax_backend
    except ImportError as err:
        raise ConfigError(f"model '{model}': the xla backend needs jax, which cannot be imported ({err}); "
                          "pip install jax (jax[cuda12] for GPUs)") from None

    if device.kind == "cpu":
        client = jax_backend.get_backend("cpu")
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
            raise ConfigError(f"model '{model}': device {device} ({origin}): jax has no CUDA GPU backend here "
                              f"({failures[-1]}); install jax with CUDA support (pip install 'jax[cuda12]') on a "
                              "machine with an NVIDIA GPU, or set device: cpu")
        devices = sorted(client.local_devices(), key=lambda d: d.id)
        if device.index >= len(devices):
            seen = ", ".join(f"cuda:{i} ({d.device_kind})" for i, d in enumerate(devices))
            raise ConfigError(f"model '{model}': device {device} ({origin}): jax sees {len(devices)} GPU(s)"
                              f"{': ' + seen if seen else ''}")
        chosen = devices[device.index]
    options = jax_backend.get_compile_options(num_replicas=1, num_partitions=1,
                                              device_assignment=np.array([[chosen.id]]), backend=client)
    return PjrtTarget(client, chosen, options)
