from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TYPE_INVALID: _ClassVar[DataType]
    TYPE_BOOL: _ClassVar[DataType]
    TYPE_UINT8: _ClassVar[DataType]
    TYPE_UINT16: _ClassVar[DataType]
    TYPE_UINT32: _ClassVar[DataType]
    TYPE_UINT64: _ClassVar[DataType]
    TYPE_INT8: _ClassVar[DataType]
    TYPE_INT16: _ClassVar[DataType]
    TYPE_INT32: _ClassVar[DataType]
    TYPE_INT64: _ClassVar[DataType]
    TYPE_FP16: _ClassVar[DataType]
    TYPE_FP32: _ClassVar[DataType]
    TYPE_FP64: _ClassVar[DataType]
    TYPE_STRING: _ClassVar[DataType]
    TYPE_BF16: _ClassVar[DataType]
TYPE_INVALID: DataType
TYPE_BOOL: DataType
TYPE_UINT8: DataType
TYPE_UINT16: DataType
TYPE_UINT32: DataType
TYPE_UINT64: DataType
TYPE_INT8: DataType
TYPE_INT16: DataType
TYPE_INT32: DataType
TYPE_INT64: DataType
TYPE_FP16: DataType
TYPE_FP32: DataType
TYPE_FP64: DataType
TYPE_STRING: DataType
TYPE_BF16: DataType

class ModelInstanceGroup(_message.Message):
    __slots__ = ("name", "kind", "count", "gpus")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_AUTO: _ClassVar[ModelInstanceGroup.Kind]
        KIND_GPU: _ClassVar[ModelInstanceGroup.Kind]
        KIND_CPU: _ClassVar[ModelInstanceGroup.Kind]
        KIND_MODEL: _ClassVar[ModelInstanceGroup.Kind]
    KIND_AUTO: ModelInstanceGroup.Kind
    KIND_GPU: ModelInstanceGroup.Kind
    KIND_CPU: ModelInstanceGroup.Kind
    KIND_MODEL: ModelInstanceGroup.Kind
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: ModelInstanceGroup.Kind
    count: int
    gpus: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[ModelInstanceGroup.Kind, str]] = ..., count: _Optional[int] = ..., gpus: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInput(_message.Message):
    __slots__ = ("name", "data_type", "dims")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    data_type: DataType
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., data_type: _Optional[_Union[DataType, str]] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelOutput(_message.Message):
    __slots__ = ("name", "data_type", "dims")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    data_type: DataType
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., data_type: _Optional[_Union[DataType, str]] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelDynamicBatching(_message.Message):
    __slots__ = ("preferred_batch_size", "max_queue_delay_microseconds", "preserve_ordering")
    PREFERRED_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DELAY_MICROSECONDS_FIELD_NUMBER: _ClassVar[int]
    PRESERVE_ORDERING_FIELD_NUMBER: _ClassVar[int]
    preferred_batch_size: _containers.RepeatedScalarFieldContainer[int]
    max_queue_delay_microseconds: int
    preserve_ordering: bool
    def __init__(self, preferred_batch_size: _Optional[_Iterable[int]] = ..., max_queue_delay_microseconds: _Optional[int] = ..., preserve_ordering: _Optional[bool] = ...) -> None: ...

class ModelParameter(_message.Message):
    __slots__ = ("string_value",)
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    string_value: str
    def __init__(self, string_value: _Optional[str] = ...) -> None: ...

class ModelConfig(_message.Message):
    __slots__ = ("name", "platform", "backend", "max_batch_size", "input", "output", "dynamic_batching", "instance_group", "parameters")
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ModelParameter
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ModelParameter, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_BATCHING_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_GROUP_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    platform: str
    backend: str
    max_batch_size: int
    input: _containers.RepeatedCompositeFieldContainer[ModelInput]
    output: _containers.RepeatedCompositeFieldContainer[ModelOutput]
    dynamic_batching: ModelDynamicBatching
    instance_group: _containers.RepeatedCompositeFieldContainer[ModelInstanceGroup]
    parameters: _containers.MessageMap[str, ModelParameter]
    def __init__(self, name: _Optional[str] = ..., platform: _Optional[str] = ..., backend: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., input: _Optional[_Iterable[_Union[ModelInput, _Mapping]]] = ..., output: _Optional[_Iterable[_Union[ModelOutput, _Mapping]]] = ..., dynamic_batching: _Optional[_Union[ModelDynamicBatching, _Mapping]] = ..., instance_group: _Optional[_Iterable[_Union[ModelInstanceGroup, _Mapping]]] = ..., parameters: _Optional[_Mapping[str, ModelParameter]] = ...) -> None: ...
