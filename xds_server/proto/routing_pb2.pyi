from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptSample(_message.Message):
    __slots__ = ("subscriber_id", "prompts")
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    subscriber_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[SampledPrompt]
    def __init__(self, subscriber_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[SampledPrompt, _Mapping]]] = ...) -> None: ...

class SampledPrompt(_message.Message):
    __slots__ = ("cluster", "prompt")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    prompt: str
    def __init__(self, cluster: _Optional[str] = ..., prompt: _Optional[str] = ...) -> None: ...

class PromptAck(_message.Message):
    __slots__ = ("accepted", "refused")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    refused: int
    def __init__(self, accepted: _Optional[int] = ..., refused: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("subscriber_id", "clusters")
    SUBSCRIBER_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    subscriber_id: str
    clusters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, subscriber_id: _Optional[str] = ..., clusters: _Optional[_Iterable[str]] = ...) -> None: ...

class RoutingUpdate(_message.Message):
    __slots__ = ("snapshot", "nodes")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    nodes: _containers.RepeatedCompositeFieldContainer[NodeRouting]
    def __init__(self, snapshot: _Optional[bool] = ..., nodes: _Optional[_Iterable[_Union[NodeRouting, _Mapping]]] = ...) -> None: ...

class NodeRouting(_message.Message):
    __slots__ = ("node_id", "cluster", "address", "routable", "state", "reason", "eds_version", "weight", "eds_health_status", "published_unix_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EDS_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    EDS_HEALTH_STATUS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    cluster: str
    address: str
    routable: bool
    state: str
    reason: str
    eds_version: str
    weight: int
    eds_health_status: str
    published_unix_s: float
    def __init__(self, node_id: _Optional[str] = ..., cluster: _Optional[str] = ..., address: _Optional[str] = ..., routable: _Optional[bool] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., eds_version: _Optional[str] = ..., weight: _Optional[int] = ..., eds_health_status: _Optional[str] = ..., published_unix_s: _Optional[float] = ...) -> None: ...
