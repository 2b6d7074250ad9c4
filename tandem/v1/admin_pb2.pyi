from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "endpoint", "kv_endpoint", "model", "running", "waiting", "kv_blocks_total", "kv_blocks_free", "draining", "heartbeat_age_s", "metrics_url")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    endpoint: str
    kv_endpoint: str
    model: str
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    draining: bool
    heartbeat_age_s: float
    metrics_url: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., endpoint: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., model: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., draining: _Optional[bool] = ..., heartbeat_age_s: _Optional[float] = ..., metrics_url: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PendingWorker(_message.Message):
    __slots__ = ("role", "state", "reason", "age_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    role: str
    state: str
    reason: str
    age_s: float
    def __init__(self, role: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., age_s: _Optional[float] = ...) -> None: ...

class ControllerEvent(_message.Message):
    __slots__ = ("time_unix", "role", "error")
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    time_unix: float
    role: str
    error: str
    def __init__(self, time_unix: _Optional[float] = ..., role: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "pending", "events")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    pending: _containers.RepeatedCompositeFieldContainer[PendingWorker]
    events: _containers.RepeatedCompositeFieldContainer[ControllerEvent]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., pending: _Optional[_Iterable[_Union[PendingWorker, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[ControllerEvent, _Mapping]]] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("prefill", "decode")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("prefill", "decode")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
