from stageserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompileConstraintRequest(_message.Message):
    __slots__ = ("constraint", "tenant")
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    constraint: _common_pb2.Constraint
    tenant: str
    def __init__(self, constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., tenant: _Optional[str] = ...) -> None: ...

class CompileConstraintReply(_message.Message):
    __slots__ = ("cached", "compile_seconds")
    CACHED_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    cached: bool
    compile_seconds: float
    def __init__(self, cached: _Optional[bool] = ..., compile_seconds: _Optional[float] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("peer",)
    PEER_FIELD_NUMBER: _ClassVar[int]
    peer: str
    def __init__(self, peer: _Optional[str] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("model_name", "vocab_size", "eos_token_ids", "max_model_len", "kv_block_size", "kv_num_blocks", "max_num_seqs", "max_step_tokens", "pipeline_depth", "backend", "dtype", "dispatch", "instance_id", "num_speculative_tokens", "speculative_method", "step_costs", "drops_unproposed_drafts", "pooling", "hidden_size", "kv_window")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    STEP_COSTS_FIELD_NUMBER: _ClassVar[int]
    DROPS_UNPROPOSED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    kv_block_size: int
    kv_num_blocks: int
    max_num_seqs: int
    max_step_tokens: int
    pipeline_depth: int
    backend: str
    dtype: str
    dispatch: str
    instance_id: str
    num_speculative_tokens: int
    speculative_method: str
    step_costs: _containers.RepeatedCompositeFieldContainer[StepCost]
    drops_unproposed_drafts: bool
    pooling: _common_pb2.Pooling
    hidden_size: int
    kv_window: int
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_num_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_step_tokens: _Optional[int] = ..., pipeline_depth: _Optional[int] = ..., backend: _Optional[str] = ..., dtype: _Optional[str] = ..., dispatch: _Optional[str] = ..., instance_id: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., speculative_method: _Optional[str] = ..., step_costs: _Optional[_Iterable[_Union[StepCost, _Mapping]]] = ..., drops_unproposed_drafts: _Optional[bool] = ..., pooling: _Optional[_Union[_common_pb2.Pooling, str]] = ..., hidden_size: _Optional[int] = ..., kv_window: _Optional[int] = ...) -> None: ...

class StepCost(_message.Message):
    __slots__ = ("rows", "drafts", "seconds", "context_tokens")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    drafts: int
    seconds: float
    context_tokens: int
    def __init__(self, rows: _Optional[int] = ..., drafts: _Optional[int] = ..., seconds: _Optional[float] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "started", "finished", "seq_index", "generation", "start_pos", "num_tokens", "token_ids", "sample", "num_new_blocks", "new_block_ids", "aborted", "num_draft_tokens", "released_seq_index", "released_num_blocks", "refusals_only")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SEQ_INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SEQ_INDEX_FIELD_NUMBER: _ClassVar[int]
    RELEASED_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_ONLY_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    started: _containers.RepeatedCompositeFieldContainer[_common_pb2.SequenceStart]
    finished: _containers.RepeatedScalarFieldContainer[int]
    seq_index: _containers.RepeatedScalarFieldContainer[int]
    generation: _containers.RepeatedScalarFieldContainer[int]
    start_pos: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: _containers.RepeatedScalarFieldContainer[bool]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    aborted: _containers.RepeatedScalarFieldContainer[str]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    released_seq_index: _containers.RepeatedScalarFieldContainer[int]
    released_num_blocks: _containers.RepeatedScalarFieldContainer[int]
    refusals_only: bool
    def __init__(self, step_id: _Optional[int] = ..., started: _Optional[_Iterable[_Union[_common_pb2.SequenceStart, _Mapping]]] = ..., finished: _Optional[_Iterable[int]] = ..., seq_index: _Optional[_Iterable[int]] = ..., generation: _Optional[_Iterable[int]] = ..., start_pos: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[_Iterable[bool]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., aborted: _Optional[_Iterable[str]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., released_seq_index: _Optional[_Iterable[int]] = ..., released_num_blocks: _Optional[_Iterable[int]] = ..., refusals_only: _Optional[bool] = ...) -> None: ...

class StepReceipt(_message.Message):
    __slots__ = ("step_id", "ticket", "slot", "error", "submitted_unix_ns")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    ticket: int
    slot: int
    error: str
    submitted_unix_ns: int
    def __init__(self, step_id: _Optional[int] = ..., ticket: _Optional[int] = ..., slot: _Optional[int] = ..., error: _Optional[str] = ..., submitted_unix_ns: _Optional[int] = ...) -> None: ...

class CompletionTicket(_message.Message):
    __slots__ = ("ticket", "step_id", "slot", "started", "seq_index", "generation", "aborted", "submitted_unix_ns")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    SEQ_INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    step_id: int
    slot: int
    started: _containers.RepeatedCompositeFieldContainer[_common_pb2.SequenceStart]
    seq_index: _containers.RepeatedScalarFieldContainer[int]
    generation: _containers.RepeatedScalarFieldContainer[int]
    aborted: _containers.RepeatedScalarFieldContainer[str]
    submitted_unix_ns: int
    def __init__(self, ticket: _Optional[int] = ..., step_id: _Optional[int] = ..., slot: _Optional[int] = ..., started: _Optional[_Iterable[_Union[_common_pb2.SequenceStart, _Mapping]]] = ..., seq_index: _Optional[_Iterable[int]] = ..., generation: _Optional[_Iterable[int]] = ..., aborted: _Optional[_Iterable[str]] = ..., submitted_unix_ns: _Optional[int] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("ticket", "step_id", "token_ids", "logprobs", "error", "completed_unix_ns", "num_tokens", "num_drafted", "row_errors", "embeddings")
    class RowErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class EmbeddingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: _common_pb2.Embedding
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[_common_pb2.Embedding, _Mapping]] = ...) -> None: ...
    TICKET_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ROW_ERRORS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    step_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    error: str
    completed_unix_ns: int
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_drafted: _containers.RepeatedScalarFieldContainer[int]
    row_errors: _containers.ScalarMap[int, str]
    embeddings: _containers.MessageMap[int, _common_pb2.Embedding]
    def __init__(self, ticket: _Optional[int] = ..., step_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., error: _Optional[str] = ..., completed_unix_ns: _Optional[int] = ..., num_tokens: _Optional[_Iterable[int]] = ..., num_drafted: _Optional[_Iterable[int]] = ..., row_errors: _Optional[_Mapping[int, str]] = ..., embeddings: _Optional[_Mapping[int, _common_pb2.Embedding]] = ...) -> None: ...

class CompletionEvent(_message.Message):
    __slots__ = ("ticket", "output")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ticket: CompletionTicket
    output: StepOutput
    def __init__(self, ticket: _Optional[_Union[CompletionTicket, _Mapping]] = ..., output: _Optional[_Union[StepOutput, _Mapping]] = ...) -> None: ...

class SlotRelease(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    def __init__(self, ticket: _Optional[int] = ...) -> None: ...
