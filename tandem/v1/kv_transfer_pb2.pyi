from tandem.v1 import api_pb2 as _api_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataPlane(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_PLANE_UNSPECIFIED: _ClassVar[DataPlane]
    DATA_PLANE_GRPC: _ClassVar[DataPlane]
    DATA_PLANE_PAIR: _ClassVar[DataPlane]
    DATA_PLANE_SHM: _ClassVar[DataPlane]
DATA_PLANE_UNSPECIFIED: DataPlane
DATA_PLANE_GRPC: DataPlane
DATA_PLANE_PAIR: DataPlane
DATA_PLANE_SHM: DataPlane

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class KVTicket(_message.Message):
    __slots__ = ("request_key", "endpoint", "block_ids", "layout", "model_fingerprint", "num_tokens", "host_id", "shared_cache", "pair_store", "timeout_s", "local_control", "ranks")
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_CACHE_FIELD_NUMBER: _ClassVar[int]
    PAIR_STORE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CONTROL_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    request_key: str
    endpoint: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    layout: KVLayout
    model_fingerprint: str
    num_tokens: int
    host_id: str
    shared_cache: str
    pair_store: str
    timeout_s: float
    local_control: str
    ranks: _containers.RepeatedCompositeFieldContainer[DecodeRank]
    def __init__(self, request_key: _Optional[str] = ..., endpoint: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., model_fingerprint: _Optional[str] = ..., num_tokens: _Optional[int] = ..., host_id: _Optional[str] = ..., shared_cache: _Optional[str] = ..., pair_store: _Optional[str] = ..., timeout_s: _Optional[float] = ..., local_control: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[DecodeRank, _Mapping]]] = ...) -> None: ...

class DecodeRank(_message.Message):
    __slots__ = ("first_head", "num_heads", "endpoint", "pair_store", "local_control", "shared_cache")
    FIRST_HEAD_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PAIR_STORE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CONTROL_FIELD_NUMBER: _ClassVar[int]
    SHARED_CACHE_FIELD_NUMBER: _ClassVar[int]
    first_head: int
    num_heads: int
    endpoint: str
    pair_store: str
    local_control: str
    shared_cache: str
    def __init__(self, first_head: _Optional[int] = ..., num_heads: _Optional[int] = ..., endpoint: _Optional[str] = ..., pair_store: _Optional[str] = ..., local_control: _Optional[str] = ..., shared_cache: _Optional[str] = ...) -> None: ...

class CudaIpcCache(_message.Message):
    __slots__ = ("device_uuid", "handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device_uuid: _Optional[str] = ..., handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class TransferHeader(_message.Message):
    __slots__ = ("request_key", "layout", "model_fingerprint", "num_tokens", "data_plane", "pair_id", "tag_base", "first_head", "num_heads")
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_BASE_FIELD_NUMBER: _ClassVar[int]
    FIRST_HEAD_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    request_key: str
    layout: KVLayout
    model_fingerprint: str
    num_tokens: int
    data_plane: DataPlane
    pair_id: str
    tag_base: int
    first_head: int
    num_heads: int
    def __init__(self, request_key: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., model_fingerprint: _Optional[str] = ..., num_tokens: _Optional[int] = ..., data_plane: _Optional[_Union[DataPlane, str]] = ..., pair_id: _Optional[str] = ..., tag_base: _Optional[int] = ..., first_head: _Optional[int] = ..., num_heads: _Optional[int] = ...) -> None: ...

class LayerChunk(_message.Message):
    __slots__ = ("layer", "offset", "data", "num_layers")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    offset: int
    data: bytes
    num_layers: int
    def __init__(self, layer: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., num_layers: _Optional[int] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprobs", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprobs: _api_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_api_pb2.TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprobs: _Optional[_Union[_api_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_api_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Trailer(_message.Message):
    __slots__ = ("first_token", "extras", "first_token_unix", "fork_first_tokens")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    FORK_FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    extras: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    first_token_unix: float
    fork_first_tokens: _containers.RepeatedCompositeFieldContainer[FirstToken]
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., extras: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ..., first_token_unix: _Optional[float] = ..., fork_first_tokens: _Optional[_Iterable[_Union[FirstToken, _Mapping]]] = ...) -> None: ...

class KeepAlive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "layer", "trailer", "keepalive")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    layer: LayerChunk
    trailer: Trailer
    keepalive: KeepAlive
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., layer: _Optional[_Union[LayerChunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ..., keepalive: _Optional[_Union[KeepAlive, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("kind", "bytes_received", "remaining_s")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[PushReply.Kind]
        ACCEPTED: _ClassVar[PushReply.Kind]
        CANCELLED: _ClassVar[PushReply.Kind]
        DONE: _ClassVar[PushReply.Kind]
    KIND_UNSPECIFIED: PushReply.Kind
    ACCEPTED: PushReply.Kind
    CANCELLED: PushReply.Kind
    DONE: PushReply.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    kind: PushReply.Kind
    bytes_received: int
    remaining_s: float
    def __init__(self, kind: _Optional[_Union[PushReply.Kind, str]] = ..., bytes_received: _Optional[int] = ..., remaining_s: _Optional[float] = ...) -> None: ...

class OpenPairRequest(_message.Message):
    __slots__ = ("pair_id", "backend", "timeout_s")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    backend: str
    timeout_s: float
    def __init__(self, pair_id: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class OpenPairReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClosePairRequest(_message.Message):
    __slots__ = ("pair_id",)
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    def __init__(self, pair_id: _Optional[str] = ...) -> None: ...

class ClosePairReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
