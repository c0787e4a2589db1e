from presto_pb.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierPrefillRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "sampling", "anchor", "restart", "decoded")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    DECODED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    anchor: int
    restart: bool
    decoded: int
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., anchor: _Optional[int] = ..., restart: _Optional[bool] = ..., decoded: _Optional[int] = ...) -> None: ...

class VerifierPrefillResponse(_message.Message):
    __slots__ = ("anchor", "delta", "base")
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    anchor: int
    delta: _common_pb2.FeatureDelta
    base: int
    def __init__(self, anchor: _Optional[int] = ..., delta: _Optional[_Union[_common_pb2.FeatureDelta, _Mapping]] = ..., base: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session", "tree", "want_node_probs")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    WANT_NODE_PROBS_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.SessionRef
    tree: _common_pb2.TokenTree
    want_node_probs: bool
    def __init__(self, session: _Optional[_Union[_common_pb2.SessionRef, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., want_node_probs: _Optional[bool] = ...) -> None: ...

class VerifyBatchRequest(_message.Message):
    __slots__ = ("items", "prefills")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    prefills: _containers.RepeatedCompositeFieldContainer[VerifierPrefillRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ..., prefills: _Optional[_Iterable[_Union[VerifierPrefillRequest, _Mapping]]] = ...) -> None: ...

class VerifyItemError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class VerifyBatchItem(_message.Message):
    __slots__ = ("result", "error")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    result: VerifyResponse
    error: VerifyItemError
    def __init__(self, result: _Optional[_Union[VerifyResponse, _Mapping]] = ..., error: _Optional[_Union[VerifyItemError, _Mapping]] = ...) -> None: ...

class PrefillBatchItem(_message.Message):
    __slots__ = ("result", "error")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    result: VerifierPrefillResponse
    error: VerifyItemError
    def __init__(self, result: _Optional[_Union[VerifierPrefillResponse, _Mapping]] = ..., error: _Optional[_Union[VerifyItemError, _Mapping]] = ...) -> None: ...

class VerifyBatchResponse(_message.Message):
    __slots__ = ("items", "prefills")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyBatchItem]
    prefills: _containers.RepeatedCompositeFieldContainer[PrefillBatchItem]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyBatchItem, _Mapping]]] = ..., prefills: _Optional[_Iterable[_Union[PrefillBatchItem, _Mapping]]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session", "anchor")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.SessionRef
    anchor: int
    def __init__(self, session: _Optional[_Union[_common_pb2.SessionRef, _Mapping]] = ..., anchor: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted", "bonus", "delta", "base", "node_probs", "accepted_nodes")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    NODE_PROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    bonus: int
    delta: _common_pb2.FeatureDelta
    base: int
    node_probs: _common_pb2.Tensor
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, accepted: _Optional[_Iterable[int]] = ..., bonus: _Optional[int] = ..., delta: _Optional[_Union[_common_pb2.FeatureDelta, _Mapping]] = ..., base: _Optional[int] = ..., node_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., accepted_nodes: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifierLimits(_message.Message):
    __slots__ = ("max_sessions", "max_context", "max_tree_nodes", "max_tree_depth")
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    max_sessions: int
    max_context: int
    max_tree_nodes: int
    max_tree_depth: int
    def __init__(self, max_sessions: _Optional[int] = ..., max_context: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., max_tree_depth: _Optional[int] = ...) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("model", "dtype", "device", "vocab_size", "eos_token_ids", "target_layer_ids", "limits", "cost", "memory", "row_invariant", "decoder", "weights", "attention_kernel", "self_draft_block", "prefill_chunk")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    ROW_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    DECODER_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_KERNEL_FIELD_NUMBER: _ClassVar[int]
    SELF_DRAFT_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    device: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    limits: VerifierLimits
    cost: _common_pb2.CostFit
    memory: _common_pb2.KVMemory
    row_invariant: bool
    decoder: str
    weights: str
    attention_kernel: str
    self_draft_block: int
    prefill_chunk: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., limits: _Optional[_Union[VerifierLimits, _Mapping]] = ..., cost: _Optional[_Union[_common_pb2.CostFit, _Mapping]] = ..., memory: _Optional[_Union[_common_pb2.KVMemory, _Mapping]] = ..., row_invariant: _Optional[bool] = ..., decoder: _Optional[str] = ..., weights: _Optional[str] = ..., attention_kernel: _Optional[str] = ..., self_draft_block: _Optional[int] = ..., prefill_chunk: _Optional[int] = ...) -> None: ...
