from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TokenTree(_message.Message):
    __slots__ = ("tokens", "parents", "depths")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    depths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., depths: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class CostFit(_message.Message):
    __slots__ = ("intercept_s", "per_node_s", "per_context_s", "per_node_context_s", "n_obs", "tree_s")
    INTERCEPT_S_FIELD_NUMBER: _ClassVar[int]
    PER_NODE_S_FIELD_NUMBER: _ClassVar[int]
    PER_CONTEXT_S_FIELD_NUMBER: _ClassVar[int]
    PER_NODE_CONTEXT_S_FIELD_NUMBER: _ClassVar[int]
    N_OBS_FIELD_NUMBER: _ClassVar[int]
    TREE_S_FIELD_NUMBER: _ClassVar[int]
    intercept_s: float
    per_node_s: float
    per_context_s: float
    per_node_context_s: float
    n_obs: int
    tree_s: float
    def __init__(self, intercept_s: _Optional[float] = ..., per_node_s: _Optional[float] = ..., per_context_s: _Optional[float] = ..., per_node_context_s: _Optional[float] = ..., n_obs: _Optional[int] = ..., tree_s: _Optional[float] = ...) -> None: ...

class TreeParams(_message.Message):
    __slots__ = ("method", "budget", "depth", "branching", "beam", "lambdas", "rho", "top_k", "cost", "draft_s", "node_penalty_s", "depth_penalty", "calibration", "shared_tokens", "round_trip_s")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    BRANCHING_FIELD_NUMBER: _ClassVar[int]
    BEAM_FIELD_NUMBER: _ClassVar[int]
    LAMBDAS_FIELD_NUMBER: _ClassVar[int]
    RHO_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    NODE_PENALTY_S_FIELD_NUMBER: _ClassVar[int]
    DEPTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    SHARED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIP_S_FIELD_NUMBER: _ClassVar[int]
    method: str
    budget: int
    depth: int
    branching: int
    beam: int
    lambdas: _containers.RepeatedScalarFieldContainer[float]
    rho: str
    top_k: int
    cost: CostFit
    draft_s: float
    node_penalty_s: float
    depth_penalty: float
    calibration: AcceptanceCalibration
    shared_tokens: float
    round_trip_s: float
    def __init__(self, method: _Optional[str] = ..., budget: _Optional[int] = ..., depth: _Optional[int] = ..., branching: _Optional[int] = ..., beam: _Optional[int] = ..., lambdas: _Optional[_Iterable[float]] = ..., rho: _Optional[str] = ..., top_k: _Optional[int] = ..., cost: _Optional[_Union[CostFit, _Mapping]] = ..., draft_s: _Optional[float] = ..., node_penalty_s: _Optional[float] = ..., depth_penalty: _Optional[float] = ..., calibration: _Optional[_Union[AcceptanceCalibration, _Mapping]] = ..., shared_tokens: _Optional[float] = ..., round_trip_s: _Optional[float] = ...) -> None: ...

class AcceptanceCalibration(_message.Message):
    __slots__ = ("alpha", "beta", "per_depth")
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    PER_DEPTH_FIELD_NUMBER: _ClassVar[int]
    alpha: float
    beta: float
    per_depth: float
    def __init__(self, alpha: _Optional[float] = ..., beta: _Optional[float] = ..., per_depth: _Optional[float] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("session_id", "base")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base: int
    def __init__(self, session_id: _Optional[str] = ..., base: _Optional[int] = ...) -> None: ...

class FeatureDelta(_message.Message):
    __slots__ = ("start", "tokens", "features")
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    features: Tensor
    def __init__(self, start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class KVMemory(_message.Message):
    __slots__ = ("bytes_per_token", "budget_bytes", "in_use_bytes")
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_USE_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes_per_token: int
    budget_bytes: int
    in_use_bytes: int
    def __init__(self, bytes_per_token: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., in_use_bytes: _Optional[int] = ...) -> None: ...
