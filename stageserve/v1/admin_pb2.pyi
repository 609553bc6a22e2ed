from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StartProfileRequest(_message.Message):
    __slots__ = ("trace_dir", "local_only", "name")
    TRACE_DIR_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    trace_dir: str
    local_only: bool
    name: str
    def __init__(self, trace_dir: _Optional[str] = ..., local_only: _Optional[bool] = ..., name: _Optional[str] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ("local_only",)
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    local_only: bool
    def __init__(self, local_only: _Optional[bool] = ...) -> None: ...

class ServiceProfile(_message.Message):
    __slots__ = ("service", "address", "trace_dir", "trace_file")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRACE_DIR_FIELD_NUMBER: _ClassVar[int]
    TRACE_FILE_FIELD_NUMBER: _ClassVar[int]
    service: str
    address: str
    trace_dir: str
    trace_file: str
    def __init__(self, service: _Optional[str] = ..., address: _Optional[str] = ..., trace_dir: _Optional[str] = ..., trace_file: _Optional[str] = ...) -> None: ...

class ProfileReply(_message.Message):
    __slots__ = ("services",)
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    services: _containers.RepeatedCompositeFieldContainer[ServiceProfile]
    def __init__(self, services: _Optional[_Iterable[_Union[ServiceProfile, _Mapping]]] = ...) -> None: ...
