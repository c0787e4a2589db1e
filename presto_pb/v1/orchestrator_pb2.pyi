from presto_pb.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "messages", "token_ids", "no_chat", "method", "tree", "sampling", "max_new_tokens", "stop", "request_id", "resume_token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NO_CHAT_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: ChatMessages
    token_ids: TokenIds
    no_chat: bool
    method: str
    tree: _common_pb2.TreeParams
    sampling: _common_pb2.SamplingParams
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., no_chat: _Optional[bool] = ..., method: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChunkStats(_message.Message):
    __slots__ = ("accepted", "tree_size", "draft_s", "verify_s", "queue_s", "transfer_s", "fallback", "gated")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    GATED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    tree_size: int
    draft_s: float
    verify_s: float
    queue_s: float
    transfer_s: float
    fallback: bool
    gated: bool
    def __init__(self, accepted: _Optional[int] = ..., tree_size: _Optional[int] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., fallback: _Optional[bool] = ..., gated: _Optional[bool] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "stats", "finish_reason", "request_id", "tree")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    stats: ChunkStats
    finish_reason: str
    request_id: str
    tree: _common_pb2.TreeParams
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., stats: _Optional[_Union[ChunkStats, _Mapping]] = ..., finish_reason: _Optional[str] = ..., request_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ...) -> None: ...

class GenerateBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "rounds", "tau", "mean_tree_size", "fallback_rounds", "prefill_s", "decode_s", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    MEAN_TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    rounds: int
    tau: float
    mean_tree_size: float
    fallback_rounds: int
    prefill_s: float
    decode_s: float
    error: _common_pb2.ItemError
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., rounds: _Optional[int] = ..., tau: _Optional[float] = ..., mean_tree_size: _Optional[float] = ..., fallback_rounds: _Optional[int] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., error: _Optional[_Union[_common_pb2.ItemError, _Mapping]] = ...) -> None: ...

class GenerateBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GenerateResult]
    def __init__(self, results: _Optional[_Iterable[_Union[GenerateResult, _Mapping]]] = ...) -> None: ...

class OrchestratorInfo(_message.Message):
    __slots__ = ("model", "drafter", "drafter_replicas", "verifier_replicas", "default_method", "default_tree", "default_max_new_tokens", "max_requests", "tokenizer", "links")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_METHOD_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TREE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    model: str
    drafter: str
    drafter_replicas: _containers.RepeatedScalarFieldContainer[str]
    verifier_replicas: _containers.RepeatedScalarFieldContainer[str]
    default_method: str
    default_tree: _common_pb2.TreeParams
    default_max_new_tokens: int
    max_requests: int
    tokenizer: bool
    links: _containers.RepeatedCompositeFieldContainer[ReplicaLink]
    def __init__(self, model: _Optional[str] = ..., drafter: _Optional[str] = ..., drafter_replicas: _Optional[_Iterable[str]] = ..., verifier_replicas: _Optional[_Iterable[str]] = ..., default_method: _Optional[str] = ..., default_tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., default_max_new_tokens: _Optional[int] = ..., max_requests: _Optional[int] = ..., tokenizer: _Optional[bool] = ..., links: _Optional[_Iterable[_Union[ReplicaLink, _Mapping]]] = ...) -> None: ...

class ReplicaLink(_message.Message):
    __slots__ = ("service", "replica", "round_trip_s", "calls")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIP_S_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    service: str
    replica: str
    round_trip_s: float
    calls: int
    def __init__(self, service: _Optional[str] = ..., replica: _Optional[str] = ..., round_trip_s: _Optional[float] = ..., calls: _Optional[int] = ...) -> None: ...
