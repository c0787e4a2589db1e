"""``to_pb`` / ``from_pb`` for the messages both services share (``common.proto``).

Everything read off the wire is checked here or by the engine it reaches; a malformed
message raises ``InvalidArgumentError`` naming the field, never a crash further in.
Lengths are checked before anything is built from a repeated field (``len`` of one is
O(1)), so an oversized message is refused at once, not after a Python object per entry.
Tensors travel as raw little-endian row-major bytes + dtype + shape (KServe v2 style).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any

import torch

from presto_pb.v1 import common_pb2 as pb
from presto_sd.engine.messages import (
    EngineError,
    FeatureDelta,
    InvalidArgumentError,
    LimitExceededError,
    UnavailableError,
)
from presto_sd.engine.sessions import KVMemory
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.acceptance_calibration import AcceptanceCalibration
from presto_sd.method.builders import RoundContext, TreeParams
from presto_sd.method.cost_model import CostFit
from presto_sd.method.tree import TokenTree
from presto_sd.rpc.errors import error_from_status, status_of

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_NDIM = 8
MAX_SESSION_ID = 256
MAX_TOKENS = 1 << 20  # tokens in one field of a request: more than any context a server holds
MAX_LAMBDAS = 256  # tree.lambdas: one per depth (the last repeats)


def check_length(n: int, limit: int, field: str) -> None:
    """Refuse a repeated field longer than ``limit`` (RESOURCE_EXHAUSTED) before it is read."""
    if n > limit:
        raise LimitExceededError(f"{field}: {n} entries, more than the limit {limit}")


# -- tensors ----------------------------------------------------------------------------
def tensor_to_pb(t: torch.Tensor) -> pb.Tensor:
    t = t.detach().cpu().contiguous()
    if t.dtype not in _NAMES:
        raise ValueError(f"tensor dtype {t.dtype} has no wire name")
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return pb.Tensor(dtype=_NAMES[t.dtype], shape=list(t.shape), data=data)


def tensor_from_pb(msg: pb.Tensor, field: str, floating: bool = False) -> torch.Tensor:
    """A tensor from its wire form; ``field`` names it in errors (e.g. ``delta.features``)."""
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise InvalidArgumentError(f"{field}.dtype = {msg.dtype!r}: not one of {', '.join(DTYPES)}")
    if floating and not dtype.is_floating_point:
        raise InvalidArgumentError(f"{field}.dtype = {msg.dtype!r}: a floating-point dtype is required")
    if len(msg.shape) > MAX_NDIM:
        raise InvalidArgumentError(f"{field}.shape: {len(msg.shape)} dims, at most {MAX_NDIM}")
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"{field}.shape = {list(shape)}: dims must be >= 0, at most {MAX_NDIM}")
    expected = math.prod(shape) * dtype.itemsize
    if len(msg.data) != expected:
        raise InvalidArgumentError(
            f"{field}.data: {len(msg.data)} bytes, expected {expected} for {msg.dtype}{list(shape)}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype).reshape(shape)


# -- trees ------------------------------------------------------------------------------
def tree_to_pb(tree: TokenTree) -> pb.TokenTree:
    return pb.TokenTree(tokens=tree.tokens, parents=tree.parents, depths=tree.depths)


def tree_from_pb(msg: pb.TokenTree, field: str = "tree", max_nodes: int | None = None) -> TokenTree:
    """Shape checks, and ``max_nodes`` (draft nodes, the root excluded) before the tree is built;
    the engine validates the rest against its own limits (``TokenTree.validate``)."""
    n = max(len(msg.tokens), len(msg.parents), len(msg.depths))
    if max_nodes is not None and n - 1 > max_nodes:
        raise LimitExceededError(f"{field}.tokens: {n - 1} draft nodes exceed the limit {max_nodes}")
    tokens, parents, depths = tuple(msg.tokens), tuple(msg.parents), tuple(msg.depths)
    if not tokens:
        raise InvalidArgumentError(f"{field}.tokens: empty tree (the root/anchor node is required)")
    if len(parents) != len(tokens) or depths and len(depths) != len(tokens):
        raise InvalidArgumentError(
            f"{field}: tokens/parents/depths lengths differ ({len(tokens)}/{len(parents)}/{len(depths)})"
        )
    if not depths:
        return TokenTree.from_lists(list(tokens), list(parents))
    return TokenTree(tokens, parents, depths)


# -- parameters -------------------------------------------------------------------------
def _set_fields(msg, cls) -> dict:
    """The dataclass fields the message sets (proto3 ``optional``); unset ones keep defaults."""
    out = {}
    for f in fields(cls):
        desc = msg.DESCRIPTOR.fields_by_name.get(f.name)
        if desc is None:
            continue
        if desc.is_repeated:
            if len(getattr(msg, f.name)):
                out[f.name] = tuple(getattr(msg, f.name))
        elif msg.HasField(f.name):
            out[f.name] = getattr(msg, f.name)
    return out


def sampling_to_pb(s: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    try:
        return SamplingParams(**_set_fields(msg, SamplingParams))
    except ValueError as e:  # the dataclass names the field: "sampling.top_p = ..."
        raise InvalidArgumentError(str(e)) from None


def cost_to_pb(c: CostFit | None) -> pb.CostFit | None:
    return None if c is None else pb.CostFit(
        intercept_s=c.intercept_s, per_node_s=c.per_node_s, per_context_s=c.per_context_s,
        per_node_context_s=c.per_node_context_s, tree_s=c.tree_s, n_obs=c.n_obs,
    )


def cost_from_pb(msg: pb.CostFit, field: str = "cost") -> CostFit:
    try:
        return CostFit(msg.intercept_s, msg.per_node_s, msg.per_context_s, msg.per_node_context_s,
                       tree_s=msg.tree_s, n_obs=msg.n_obs)
    except ValueError as e:
        raise InvalidArgumentError(f"{field}: {e}") from None


def tree_params_to_pb(p: TreeParams, context: RoundContext | None = None,
                      method: str | None = None) -> pb.TreeParams:
    """A tree's parameters, and a draft call's method and round measurements (the wire keeps
    the three in one ``TreeParams`` message: field 1 is the method, fields 9, 10 and 13-15
    the round's)."""
    msg = pb.TreeParams(
        method=method, budget=p.budget, depth=p.depth, branching=p.branching, beam=p.beam,
        lambdas=p.lambdas, rho=p.rho, top_k=p.top_k, node_penalty_s=p.node_penalty_s,
        depth_penalty=p.depth_penalty,
    )
    if context is not None:
        c = context.calibration
        msg.MergeFrom(pb.TreeParams(
            cost=cost_to_pb(context.cost), draft_s=context.draft_s, shared_tokens=context.shared_tokens,
            round_trip_s=context.round_trip_s,
            calibration=None if c.is_identity else pb.AcceptanceCalibration(
                alpha=c.alpha, beta=c.beta, per_depth=c.per_depth)))
    return msg


def tree_params_from_pb(msg: pb.TreeParams) -> TreeParams:
    if len(msg.lambdas) > MAX_LAMBDAS:
        raise InvalidArgumentError(f"tree.lambdas: {len(msg.lambdas)} values, at most {MAX_LAMBDAS}")
    kwargs = _set_fields(msg, TreeParams)
    if any(not math.isfinite(lam) for lam in kwargs.get("lambdas", ())):
        raise InvalidArgumentError(f"tree.lambdas = {kwargs['lambdas']}: must be finite")
    try:
        return TreeParams(**kwargs)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None


def round_context_from_pb(msg: pb.TreeParams) -> RoundContext:
    """The round's measurements a draft call's ``TreeParams`` message carries (unset: none)."""
    kwargs = {k: v for k, v in _set_fields(msg, RoundContext).items() if k not in ("cost", "calibration")}
    if msg.HasField("cost"):
        kwargs["cost"] = cost_from_pb(msg.cost, "tree.cost")
    if msg.HasField("calibration"):
        c = msg.calibration
        try:
            kwargs["calibration"] = AcceptanceCalibration(c.alpha, c.beta, c.per_depth)
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from None
    try:
        return RoundContext(**kwargs)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None


# -- sessions and feature deltas --------------------------------------------------------
def session_id_from(session_id: str, field: str = "session_id") -> str:
    if not session_id or len(session_id) > MAX_SESSION_ID:
        raise InvalidArgumentError(f"{field}: must be 1..{MAX_SESSION_ID} characters")
    return session_id


def memory_to_pb(m: KVMemory) -> pb.KVMemory:
    return pb.KVMemory(bytes_per_token=m.bytes_per_token, budget_bytes=m.budget_bytes or 0,
                       in_use_bytes=m.in_use_bytes)


def memory_from_pb(msg: pb.KVMemory) -> KVMemory:
    return KVMemory(msg.bytes_per_token, msg.budget_bytes or None, msg.in_use_bytes)


def session_ref_to_pb(session_id: str, base: int) -> pb.SessionRef:
    return pb.SessionRef(session_id=session_id, base=base)


def session_ref_from_pb(msg: pb.SessionRef) -> tuple[str, int]:
    if msg.base < 0:
        raise InvalidArgumentError(f"session.base = {msg.base}: must be >= 0")
    return session_id_from(msg.session_id, "session.session_id"), msg.base


def delta_to_pb(d: FeatureDelta) -> pb.FeatureDelta:
    return pb.FeatureDelta(start=d.start, tokens=d.tokens, features=tensor_to_pb(d.features))


def delta_from_pb(msg: pb.FeatureDelta, field: str = "delta") -> FeatureDelta:
    if msg.start < 0:
        raise InvalidArgumentError(f"{field}.start = {msg.start}: must be >= 0")
    if not msg.HasField("features"):
        raise InvalidArgumentError(f"{field}.features: missing")
    check_length(len(msg.tokens), MAX_TOKENS, f"{field}.tokens")
    features = tensor_from_pb(msg.features, f"{field}.features", floating=True)
    return FeatureDelta(msg.start, tuple(msg.tokens), features)  # checks the shape


# -- batched calls: each item its own call or error (VerifyBatch, DraftBatch, GenerateBatch) --
def items_from_pb(items: Iterable[Any], call_from_pb: Callable[[Any], Any]) -> list[Any]:
    """Each item as a call, or the error its malformed message gets (its slot, not the batch's)."""
    out = []
    for item in items:
        try:
            out.append(call_from_pb(item))
        except EngineError as e:
            out.append(e)
    return out


def item_error_fields(e: BaseException) -> dict[str, str]:
    """An item's error as an ``ItemError``'s fields: the status code name and its message."""
    code, message = status_of(e)
    return {"code": code.name, "message": message}


def answers_from_pb(
    items: Iterable[Any], result_from_pb: Callable[[Any], Any], unavailable: type[UnavailableError]
) -> list[Any]:
    """Results, and errors as the named exceptions a unary call raises for the same status."""
    return [result_from_pb(item.result) if item.HasField("result")
            else error_from_status(item.error.code, item.error.message, unavailable) for item in items]
