from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorDeclaration(_message.Message):
    __slots__ = ("name", "data_type", "dims")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    data_type: str
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., data_type: _Optional[str] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInference(_message.Message):
    __slots__ = ("input_shape", "output_shape", "max_batch_size", "data_type", "input", "output")
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_TYPE_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    output_shape: _containers.RepeatedScalarFieldContainer[int]
    max_batch_size: int
    data_type: str
    input: _containers.RepeatedCompositeFieldContainer[TensorDeclaration]
    output: _containers.RepeatedCompositeFieldContainer[TensorDeclaration]
    def __init__(self, input_shape: _Optional[_Iterable[int]] = ..., output_shape: _Optional[_Iterable[int]] = ..., max_batch_size: _Optional[int] = ..., data_type: _Optional[str] = ..., input: _Optional[_Iterable[_Union[TensorDeclaration, _Mapping]]] = ..., output: _Optional[_Iterable[_Union[TensorDeclaration, _Mapping]]] = ...) -> None: ...
