from stageserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeRequest(_message.Message):
    __slots__ = ("peer",)
    PEER_FIELD_NUMBER: _ClassVar[int]
    peer: str
    def __init__(self, peer: _Optional[str] = ...) -> None: ...

class StepEvents(_message.Message):
    __slots__ = ("step_id", "ticket", "events", "device_instance_id", "error_code", "error_message")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    ticket: int
    events: _containers.RepeatedCompositeFieldContainer[SequenceEvent]
    device_instance_id: str
    error_code: int
    error_message: str
    def __init__(self, step_id: _Optional[int] = ..., ticket: _Optional[int] = ..., events: _Optional[_Iterable[_Union[SequenceEvent, _Mapping]]] = ..., device_instance_id: _Optional[str] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class SequenceEvent(_message.Message):
    __slots__ = ("request_id", "seq_index", "generation", "token_ids", "text", "logprobs", "finish_reason", "stop_string", "stop_token_id", "prompt_tokens", "completion_tokens", "error_code", "error_message", "draft_tokens", "accepted_tokens", "embedding", "settled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq_index: int
    generation: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    stop_string: str
    stop_token_id: int
    prompt_tokens: int
    completion_tokens: int
    error_code: int
    error_message: str
    draft_tokens: int
    accepted_tokens: int
    embedding: _containers.RepeatedScalarFieldContainer[float]
    settled: bool
    def __init__(self, request_id: _Optional[str] = ..., seq_index: _Optional[int] = ..., generation: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., embedding: _Optional[_Iterable[float]] = ..., settled: _Optional[bool] = ...) -> None: ...
