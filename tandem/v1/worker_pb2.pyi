from tandem.v1 import api_pb2 as _api_pb2
from tandem.v1 import kv_transfer_pb2 as _kv_transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "speculative", "output_offset", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _api_pb2.SamplingOptions
    priority: int
    speculative: bool
    output_offset: int
    n: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_api_pb2.SamplingOptions, _Mapping]] = ..., priority: _Optional[int] = ..., speculative: _Optional[bool] = ..., output_offset: _Optional[int] = ..., n: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "local_prefill")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    local_prefill: bool
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "draft_tokens", "accepted_tokens", "transfer_s", "index", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_api_pb2.TokenLogprob]
    finish_reason: str
    draft_tokens: int
    accepted_tokens: int
    transfer_s: float
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_api_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_api_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., transfer_s: _Optional[float] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_api_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("ticket", "tokens")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ticket: _kv_transfer_pb2.KVTicket
    tokens: TokenChunk
    def __init__(self, ticket: _Optional[_Union[_kv_transfer_pb2.KVTicket, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "ticket")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    ticket: _kv_transfer_pb2.KVTicket
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ..., ticket: _Optional[_Union[_kv_transfer_pb2.KVTicket, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "data_plane", "kv_bytes", "prefill_s", "transfer_s")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    data_plane: str
    kv_bytes: int
    prefill_s: float
    transfer_s: float
    def __init__(self, first_token: _Optional[int] = ..., data_plane: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ...) -> None: ...

class WorkerAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class WorkerAbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("role", "model", "running", "waiting", "kv_blocks_total", "kv_blocks_free", "draining")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    draining: bool
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...
