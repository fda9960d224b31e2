"""What the data plane says about models, protocol-neutral: each protocol surface only formats it."""

from __future__ import annotations

from dataclasses import dataclass

from nereid.backend import reported_device
from nereid.model_entry import LoadedVersion
from nereid.settings import ModelSettings
from nereid.signature import TensorSpec

# nereid serves one version of each model; every protocol spells it the same way.
MODEL_VERSION = "1"


@dataclass(frozen=True)
class TensorInfo:
    """One input or output: its name, wire datatype (``FP32``) and shape (``-1`` for variable axes)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def config_type(self) -> str:
        """The datatype as Triton's model configuration spells it: ``TYPE_FP32``, and ``TYPE_STRING`` for
        BYTES (gRPC's ModelConfig enum value name, and the HTTP config's text alike)."""
        return "TYPE_STRING" if self.datatype == "BYTES" else f"TYPE_{self.datatype}"


@dataclass(frozen=True)
class ModelMetadata:
    """KServe's model metadata: shapes with a leading ``-1`` when the model batches."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]


@dataclass(frozen=True)
class DynamicBatching:
    """What the scheduler really does when it batches (Triton's ``dynamic_batching``)."""

    max_queue_delay_us: int
    preferred_batch_sizes: tuple[int, ...]


@dataclass(frozen=True)
class InstanceGroup:
    """Where and how many executions run at once (Triton's ``instance_group``)."""

    count: int
    kind: str  # KIND_CPU or KIND_GPU
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    """Triton's model configuration, derived from the model's contract (dims exclude the batch axis)."""

    name: str
    platform: str
    backend: str
    max_batch_size: int
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    dynamic_batching: DynamicBatching | None
    instance_group: InstanceGroup


@dataclass(frozen=True)
class IndexEntry:
    """One model folder in the repository index."""

    name: str
    version: str
    state: str
    reason: str


def describe_metadata(name: str, model: LoadedVersion) -> ModelMetadata:
    """A loaded model's metadata."""
    batch = (-1,) if model.signature.batches else ()

    def info(spec: TensorSpec) -> TensorInfo:
        return TensorInfo(spec.name, spec.dtype.kserve, batch + tuple(spec.dims))

    return ModelMetadata(name, (MODEL_VERSION,), model.backend.platform,
                         tuple(map(info, model.signature.inputs)), tuple(map(info, model.signature.outputs)))


def describe_config(name: str, model: LoadedVersion, settings: ModelSettings) -> ModelConfig:
    """A loaded model's configuration, as its scheduler and settings make it."""
    signature = model.signature

    def info(spec: TensorSpec) -> TensorInfo:
        return TensorInfo(spec.name, spec.dtype.kserve, tuple(spec.dims))

    policy = model.scheduler.policy
    # Off for max_batch_size 0 or `batching: enabled: false`: what the scheduler really does. Rounded, not cut: a
    # Triton config's 1001 us, written as 1.001 ms, came back as 1000.
    batching = DynamicBatching(round(policy.max_delay_ns / 1000), tuple(policy.preferred_sizes)) if policy.enabled else None
    device = reported_device(settings.device, model.uses_device)  # (a meta model's cuda:0 is ignored: on the CPU)
    # The scheduler's count: a meta model runs up to queue_capacity orchestrations, whatever `instances` says.
    group = InstanceGroup(model.scheduler.instances, "KIND_GPU" if device.is_gpu else "KIND_CPU",
                          (device.index,) if device.is_gpu else ())
    return ModelConfig(name, model.backend.platform, model.backend_name, signature.max_batch_size,
                       tuple(map(info, signature.inputs)), tuple(map(info, signature.outputs)), batching, group)
