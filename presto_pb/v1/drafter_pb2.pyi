from presto_pb.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterPrefillRequest(_message.Message):
    __slots__ = ("session_id", "delta", "restart")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    delta: _common_pb2.FeatureDelta
    restart: bool
    def __init__(self, session_id: _Optional[str] = ..., delta: _Optional[_Union[_common_pb2.FeatureDelta, _Mapping]] = ..., restart: _Optional[bool] = ...) -> None: ...

class DrafterPrefillResponse(_message.Message):
    __slots__ = ("base",)
    BASE_FIELD_NUMBER: _ClassVar[int]
    base: int
    def __init__(self, base: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session", "anchor", "params", "want_marginals", "commit")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    WANT_MARGINALS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.SessionRef
    anchor: int
    params: _common_pb2.TreeParams
    want_marginals: bool
    commit: _common_pb2.FeatureDelta
    def __init__(self, session: _Optional[_Union[_common_pb2.SessionRef, _Mapping]] = ..., anchor: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., want_marginals: _Optional[bool] = ..., commit: _Optional[_Union[_common_pb2.FeatureDelta, _Mapping]] = ...) -> None: ...

class Marginals(_message.Message):
    __slots__ = ("token_ids", "log_probs", "entropy", "hidden")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _common_pb2.Tensor
    log_probs: _common_pb2.Tensor
    entropy: _common_pb2.Tensor
    hidden: _common_pb2.Tensor
    def __init__(self, token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., log_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., entropy: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("tree", "path_scores", "marginals", "forward_s", "build_s", "node_log_acceptance")
    TREE_FIELD_NUMBER: _ClassVar[int]
    PATH_SCORES_FIELD_NUMBER: _ClassVar[int]
    MARGINALS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BUILD_S_FIELD_NUMBER: _ClassVar[int]
    NODE_LOG_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.TokenTree
    path_scores: _containers.RepeatedScalarFieldContainer[float]
    marginals: Marginals
    forward_s: float
    build_s: float
    node_log_acceptance: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., path_scores: _Optional[_Iterable[float]] = ..., marginals: _Optional[_Union[Marginals, _Mapping]] = ..., forward_s: _Optional[float] = ..., build_s: _Optional[float] = ..., node_log_acceptance: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DraftRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[DraftRequest, _Mapping]]] = ...) -> None: ...

class DraftBatchItem(_message.Message):
    __slots__ = ("result", "error")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    result: DraftResponse
    error: _common_pb2.ItemError
    def __init__(self, result: _Optional[_Union[DraftResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.ItemError, _Mapping]] = ...) -> None: ...

class DraftBatchResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DraftBatchItem]
    def __init__(self, items: _Optional[_Iterable[_Union[DraftBatchItem, _Mapping]]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session", "delta")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.SessionRef
    delta: _common_pb2.FeatureDelta
    def __init__(self, session: _Optional[_Union[_common_pb2.SessionRef, _Mapping]] = ..., delta: _Optional[_Union[_common_pb2.FeatureDelta, _Mapping]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("base",)
    BASE_FIELD_NUMBER: _ClassVar[int]
    base: int
    def __init__(self, base: _Optional[int] = ...) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("block_size", "target_layer_ids", "mask_token_id", "vocab_size", "methods", "rho_providers", "name", "default_rho", "default_lambdas", "max_sessions", "lambdas_by_rho", "memory")
    class LambdasByRhoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Lambdas
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Lambdas, _Mapping]] = ...) -> None: ...
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    RHO_PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_RHO_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_LAMBDAS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LAMBDAS_BY_RHO_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    mask_token_id: int
    vocab_size: int
    methods: _containers.RepeatedScalarFieldContainer[str]
    rho_providers: _containers.RepeatedScalarFieldContainer[str]
    name: str
    default_rho: str
    default_lambdas: _containers.RepeatedScalarFieldContainer[float]
    max_sessions: int
    lambdas_by_rho: _containers.MessageMap[str, Lambdas]
    memory: _common_pb2.KVMemory
    def __init__(self, block_size: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., mask_token_id: _Optional[int] = ..., vocab_size: _Optional[int] = ..., methods: _Optional[_Iterable[str]] = ..., rho_providers: _Optional[_Iterable[str]] = ..., name: _Optional[str] = ..., default_rho: _Optional[str] = ..., default_lambdas: _Optional[_Iterable[float]] = ..., max_sessions: _Optional[int] = ..., lambdas_by_rho: _Optional[_Mapping[str, Lambdas]] = ..., memory: _Optional[_Union[_common_pb2.KVMemory, _Mapping]] = ...) -> None: ...

class Lambdas(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...
