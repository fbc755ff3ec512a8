from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Liveness(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIVENESS_UNSPECIFIED: _ClassVar[Liveness]
    LIVENESS_HEARTBEAT: _ClassVar[Liveness]
    LIVENESS_TRANSPORT: _ClassVar[Liveness]

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    ENGINE_STATE_COLD: _ClassVar[EngineState]
    ENGINE_STATE_WARMING: _ClassVar[EngineState]
    ENGINE_STATE_READY: _ClassVar[EngineState]
    ENGINE_STATE_FAILED: _ClassVar[EngineState]

class NvmlState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NVML_STATE_UNSPECIFIED: _ClassVar[NvmlState]
    NVML_STATE_OK: _ClassVar[NvmlState]
    NVML_STATE_ABSENT: _ClassVar[NvmlState]
    NVML_STATE_ERROR: _ClassVar[NvmlState]

class FailureKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_KIND_UNSPECIFIED: _ClassVar[FailureKind]
    FAILURE_KIND_TIMEOUT: _ClassVar[FailureKind]
    FAILURE_KIND_CONNECT: _ClassVar[FailureKind]
    FAILURE_KIND_HTTP_STATUS: _ClassVar[FailureKind]
    FAILURE_KIND_ENGINE_FATAL: _ClassVar[FailureKind]
    FAILURE_KIND_BAD_OUTPUT: _ClassVar[FailureKind]
LIVENESS_UNSPECIFIED: Liveness
LIVENESS_HEARTBEAT: Liveness
LIVENESS_TRANSPORT: Liveness
ENGINE_STATE_UNSPECIFIED: EngineState
ENGINE_STATE_COLD: EngineState
ENGINE_STATE_WARMING: EngineState
ENGINE_STATE_READY: EngineState
ENGINE_STATE_FAILED: EngineState
NVML_STATE_UNSPECIFIED: NvmlState
NVML_STATE_OK: NvmlState
NVML_STATE_ABSENT: NvmlState
NVML_STATE_ERROR: NvmlState
FAILURE_KIND_UNSPECIFIED: FailureKind
FAILURE_KIND_TIMEOUT: FailureKind
FAILURE_KIND_CONNECT: FailureKind
FAILURE_KIND_HTTP_STATUS: FailureKind
FAILURE_KIND_ENGINE_FATAL: FailureKind
FAILURE_KIND_BAD_OUTPUT: FailureKind

class ControlMessage(_message.Message):
    __slots__ = ("hello", "ping", "probe_now", "replay")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    PROBE_NOW_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    ping: Ping
    probe_now: ProbeNow
    replay: ReplayRequest
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., probe_now: _Optional[_Union[ProbeNow, _Mapping]] = ..., replay: _Optional[_Union[ReplayRequest, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("control_plane_id", "liveness", "telemetry_refresh_ms")
    CONTROL_PLANE_ID_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_REFRESH_MS_FIELD_NUMBER: _ClassVar[int]
    control_plane_id: str
    liveness: Liveness
    telemetry_refresh_ms: int
    def __init__(self, control_plane_id: _Optional[str] = ..., liveness: _Optional[_Union[Liveness, str]] = ..., telemetry_refresh_ms: _Optional[int] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class ProbeNow(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ReplayRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "max_tokens", "timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedScalarFieldContainer[str]
    max_tokens: int
    timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[str]] = ..., max_tokens: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("heartbeat", "pong", "inference_result", "replay_result", "register")
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_RESULT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_RESULT_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    heartbeat: Heartbeat
    pong: Pong
    inference_result: InferenceResult
    replay_result: ReplayResult
    register: Register
    def __init__(self, heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., pong: _Optional[_Union[Pong, _Mapping]] = ..., inference_result: _Optional[_Union[InferenceResult, _Mapping]] = ..., replay_result: _Optional[_Union[ReplayResult, _Mapping]] = ..., register: _Optional[_Union[Register, _Mapping]] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("node_id", "cluster", "address", "locality", "priority", "capacity", "agent_version")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    cluster: str
    address: str
    locality: Locality
    priority: int
    capacity: int
    agent_version: str
    def __init__(self, node_id: _Optional[str] = ..., cluster: _Optional[str] = ..., address: _Optional[str] = ..., locality: _Optional[_Union[Locality, _Mapping]] = ..., priority: _Optional[int] = ..., capacity: _Optional[int] = ..., agent_version: _Optional[str] = ...) -> None: ...

class Locality(_message.Message):
    __slots__ = ("region", "zone", "sub_zone")
    REGION_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    SUB_ZONE_FIELD_NUMBER: _ClassVar[int]
    region: str
    zone: str
    sub_zone: str
    def __init__(self, region: _Optional[str] = ..., zone: _Optional[str] = ..., sub_zone: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "interval_ms", "node_id", "telemetry", "liveness", "replay_max_prompts")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_MAX_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    interval_ms: int
    node_id: str
    telemetry: Telemetry
    liveness: Liveness
    replay_max_prompts: int
    def __init__(self, seq: _Optional[int] = ..., interval_ms: _Optional[int] = ..., node_id: _Optional[str] = ..., telemetry: _Optional[_Union[Telemetry, _Mapping]] = ..., liveness: _Optional[_Union[Liveness, str]] = ..., replay_max_prompts: _Optional[int] = ...) -> None: ...

class Pong(_message.Message):
    __slots__ = ("seq", "processing_us")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_US_FIELD_NUMBER: _ClassVar[int]
    seq: int
    processing_us: int
    def __init__(self, seq: _Optional[int] = ..., processing_us: _Optional[int] = ...) -> None: ...

class Telemetry(_message.Message):
    __slots__ = ("engine_state", "engine_load", "gpu", "stalled", "stall_detail", "progress_age_ms", "progress_detail")
    ENGINE_STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_LOAD_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    STALL_DETAIL_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_DETAIL_FIELD_NUMBER: _ClassVar[int]
    engine_state: EngineState
    engine_load: EngineLoad
    gpu: GpuTelemetry
    stalled: bool
    stall_detail: str
    progress_age_ms: int
    progress_detail: str
    def __init__(self, engine_state: _Optional[_Union[EngineState, str]] = ..., engine_load: _Optional[_Union[EngineLoad, _Mapping]] = ..., gpu: _Optional[_Union[GpuTelemetry, _Mapping]] = ..., stalled: _Optional[bool] = ..., stall_detail: _Optional[str] = ..., progress_age_ms: _Optional[int] = ..., progress_detail: _Optional[str] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("metrics_ok", "metrics_error", "age_ms", "requests_waiting", "requests_running", "kv_cache_usage_ratio", "prefix_cache_hit_ratio", "generation_tokens_total", "kv_cache_metric", "requests_finished_total")
    METRICS_OK_FIELD_NUMBER: _ClassVar[int]
    METRICS_ERROR_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_RATIO_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_METRIC_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    metrics_ok: bool
    metrics_error: str
    age_ms: int
    requests_waiting: float
    requests_running: float
    kv_cache_usage_ratio: float
    prefix_cache_hit_ratio: float
    generation_tokens_total: float
    kv_cache_metric: str
    requests_finished_total: float
    def __init__(self, metrics_ok: _Optional[bool] = ..., metrics_error: _Optional[str] = ..., age_ms: _Optional[int] = ..., requests_waiting: _Optional[float] = ..., requests_running: _Optional[float] = ..., kv_cache_usage_ratio: _Optional[float] = ..., prefix_cache_hit_ratio: _Optional[float] = ..., generation_tokens_total: _Optional[float] = ..., kv_cache_metric: _Optional[str] = ..., requests_finished_total: _Optional[float] = ...) -> None: ...

class GpuTelemetry(_message.Message):
    __slots__ = ("state", "error", "gpus", "poll_seq")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    POLL_SEQ_FIELD_NUMBER: _ClassVar[int]
    state: NvmlState
    error: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuReading]
    poll_seq: int
    def __init__(self, state: _Optional[_Union[NvmlState, str]] = ..., error: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuReading, _Mapping]]] = ..., poll_seq: _Optional[int] = ...) -> None: ...

class GpuReading(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total_bytes", "memory_used_bytes", "utilization_ratio", "temperature_c", "power_w", "ecc_uncorrected", "xid_events", "throttle_reasons", "errors")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_RATIO_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    ECC_UNCORRECTED_FIELD_NUMBER: _ClassVar[int]
    XID_EVENTS_FIELD_NUMBER: _ClassVar[int]
    THROTTLE_REASONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_ratio: float
    temperature_c: float
    power_w: float
    ecc_uncorrected: int
    xid_events: _containers.RepeatedScalarFieldContainer[int]
    throttle_reasons: int
    errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., utilization_ratio: _Optional[float] = ..., temperature_c: _Optional[float] = ..., power_w: _Optional[float] = ..., ecc_uncorrected: _Optional[int] = ..., xid_events: _Optional[_Iterable[int]] = ..., throttle_reasons: _Optional[int] = ..., errors: _Optional[_Iterable[str]] = ...) -> None: ...

class InferenceResult(_message.Message):
    __slots__ = ("seq", "ok", "ttft_ms", "failure", "http_status", "detail", "timeout_ms", "headers_ms", "trigger")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    HEADERS_MS_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ok: bool
    ttft_ms: float
    failure: FailureKind
    http_status: int
    detail: str
    timeout_ms: int
    headers_ms: float
    trigger: str
    def __init__(self, seq: _Optional[int] = ..., ok: _Optional[bool] = ..., ttft_ms: _Optional[float] = ..., failure: _Optional[_Union[FailureKind, str]] = ..., http_status: _Optional[int] = ..., detail: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., headers_ms: _Optional[float] = ..., trigger: _Optional[str] = ...) -> None: ...

class ReplayResult(_message.Message):
    __slots__ = ("request_id", "node_id", "answers", "error", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    node_id: str
    answers: _containers.RepeatedCompositeFieldContainer[ReplayAnswer]
    error: str
    model: str
    def __init__(self, request_id: _Optional[str] = ..., node_id: _Optional[str] = ..., answers: _Optional[_Iterable[_Union[ReplayAnswer, _Mapping]]] = ..., error: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class ReplayAnswer(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "error", "elapsed_ms")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    error: str
    elapsed_ms: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., elapsed_ms: _Optional[float] = ...) -> None: ...
