"""``to_pb`` / ``from_pb`` for the verifier's own messages (``verifier.proto``)."""

from __future__ import annotations

from collections.abc import Sequence

from presto_pb.v1 import verifier_pb2 as pb
from presto_sd.engine.messages import EngineError, InvalidArgumentError, UnavailableError
from presto_sd.engine.verifier import (
    BatchAnswer,
    BatchCall,
    PrefillCall,
    PrefillResult,
    VerifierInfo,
    VerifierLimits,
    VerifyCall,
    VerifyResult,
)
from presto_sd.method.tree import TreeLimits
from presto_sd.rpc.wire import (
    answers_from_pb,
    cost_from_pb,
    cost_to_pb,
    delta_from_pb,
    delta_to_pb,
    item_error_fields,
    items_from_pb,
    memory_from_pb,
    memory_to_pb,
    sampling_from_pb,
    sampling_to_pb,
    session_id_from,
    session_ref_from_pb,
    session_ref_to_pb,
    tensor_from_pb,
    tensor_to_pb,
    tree_from_pb,
    tree_to_pb,
)

# -- the most bytes a response can take, known before the call runs ---------------------
_VARINT = 11  # a field's tag + the longest varint of an int32 / int64 value
_MESSAGE = 64  # a (sub)message's tag and length, a tensor's dtype name and shape


def delta_bound(rows: int, row_bytes: int) -> int:
    """A ``FeatureDelta`` of ``rows`` tokens with feature rows of ``row_bytes``."""
    return rows * (row_bytes + _VARINT) + 4 * _MESSAGE


def prefill_response_bound(tokens: int, row_bytes: int) -> int:
    return delta_bound(tokens, row_bytes) + 2 * _VARINT + _MESSAGE


def verify_response_bound(c: VerifyCall, row_bytes: int) -> int:
    """The accepted path has at most ``min(depth, nodes - 1) + 1`` nodes; ``node_probs`` 4 B a node."""
    rows = min(c.tree.max_depth, len(c.tree.tokens) - 1) + 1
    probs = 4 * len(c.tree.tokens) + _MESSAGE if c.want_node_probs else 0
    return delta_bound(rows, row_bytes) + 2 * rows * _VARINT + probs + 2 * _VARINT + _MESSAGE


ITEM_ERROR_BOUND = 4096  # one VerifyBatch item's error: its code name and message


def prefill_result_to_pb(r: PrefillResult) -> pb.VerifierPrefillResponse:
    return pb.VerifierPrefillResponse(anchor=r.anchor, delta=delta_to_pb(r.delta), base=r.base)


def prefill_result_from_pb(msg: pb.VerifierPrefillResponse) -> PrefillResult:
    return PrefillResult(anchor=msg.anchor, delta=delta_from_pb(msg.delta), base=msg.base)


def verify_result_to_pb(r: VerifyResult) -> pb.VerifyResponse:
    msg = pb.VerifyResponse(
        accepted=r.accepted, bonus=r.bonus, delta=delta_to_pb(r.delta), base=r.base,
        accepted_nodes=r.accepted_nodes,
    )
    if r.node_probs is not None:
        msg.node_probs.CopyFrom(tensor_to_pb(r.node_probs.float()))
    return msg


def verify_result_from_pb(msg: pb.VerifyResponse) -> VerifyResult:
    node_probs = tensor_from_pb(msg.node_probs, "node_probs") if msg.HasField("node_probs") else None
    return VerifyResult(
        accepted=tuple(msg.accepted), bonus=msg.bonus, delta=delta_from_pb(msg.delta), base=msg.base,
        node_probs=node_probs, accepted_nodes=tuple(msg.accepted_nodes),
    )


def verify_call_to_pb(c: VerifyCall) -> pb.VerifyRequest:
    if c.chains is not None:  # the next block would have to come back through the drafter's client
        raise InvalidArgumentError("verify.chains: self-speculative mask rows are not on the wire; the mode "
                                   "runs embedded (presto-sd generate/bench --drafter self)")
    return pb.VerifyRequest(
        session=session_ref_to_pb(c.session_id, c.base), tree=tree_to_pb(c.tree),
        want_node_probs=c.want_node_probs,
    )


def verify_call_from_pb(msg: pb.VerifyRequest, max_nodes: int | None = None) -> VerifyCall:
    session_id, base = session_ref_from_pb(msg.session)
    return VerifyCall(session_id, base, tree_from_pb(msg.tree, max_nodes=max_nodes), msg.want_node_probs)


def prefill_call_to_pb(c: PrefillCall) -> pb.VerifierPrefillRequest:
    if c.decoded < 0:  # uint32 on the wire: the engine's own check, before protobuf's ValueError
        raise InvalidArgumentError(f"prefill.decoded = {c.decoded}: must be >= 0")
    return pb.VerifierPrefillRequest(session_id=c.session_id, token_ids=c.token_ids,
                                     sampling=sampling_to_pb(c.sampling), anchor=c.anchor, restart=c.restart,
                                     decoded=c.decoded)


def prefill_call_from_pb(msg: pb.VerifierPrefillRequest) -> PrefillCall:
    sampling = sampling_from_pb(msg.sampling) if msg.HasField("sampling") else PrefillCall.sampling
    anchor = msg.anchor if msg.HasField("anchor") else None
    return PrefillCall(session_id_from(msg.session_id), tuple(msg.token_ids), sampling, anchor, msg.restart,
                       msg.decoded)


# -- VerifyBatch: per item, its result or its own status ---------------------------------
# On the wire the trees travel in ``items`` and the prompts in ``prefills``; in Python one
# list holds both, the trees first (``verify_calls_from_pb``), in the caller's order.
def verify_batch_request_to_pb(calls: Sequence[BatchCall]) -> pb.VerifyBatchRequest:
    return pb.VerifyBatchRequest(
        items=[verify_call_to_pb(c) for c in calls if isinstance(c, VerifyCall)],
        prefills=[prefill_call_to_pb(c) for c in calls if isinstance(c, PrefillCall)])


def verify_calls_from_pb(
    msg: pb.VerifyBatchRequest, max_nodes: int | None = None
) -> list[BatchCall | EngineError]:
    """The trees, then the prompts; a malformed one is its own error."""
    return [*items_from_pb(msg.items, lambda item: verify_call_from_pb(item, max_nodes)),
            *items_from_pb(msg.prefills, prefill_call_from_pb)]


def verify_batch_to_pb(answers: Sequence[BatchAnswer], trees: int | None = None) -> pb.VerifyBatchResponse:
    """``answers``: the ``trees`` items' answers, then the prompts' (all items if not given)."""
    trees = len(answers) if trees is None else trees

    def error(e: EngineError) -> pb.VerifyItemError:
        return pb.VerifyItemError(**item_error_fields(e))

    return pb.VerifyBatchResponse(
        items=[pb.VerifyBatchItem(error=error(a)) if isinstance(a, EngineError)
               else pb.VerifyBatchItem(result=verify_result_to_pb(a)) for a in answers[:trees]],
        prefills=[pb.PrefillBatchItem(error=error(a)) if isinstance(a, EngineError)
                  else pb.PrefillBatchItem(result=prefill_result_to_pb(a)) for a in answers[trees:]])


def verify_batch_from_pb(
    msg: pb.VerifyBatchResponse, unavailable: type[UnavailableError]
) -> list[BatchAnswer]:
    """The trees' answers, then the prompts'."""
    return [*answers_from_pb(msg.items, verify_result_from_pb, unavailable),
            *answers_from_pb(msg.prefills, prefill_result_from_pb, unavailable)]


def info_to_pb(i: VerifierInfo) -> pb.VerifierInfo:
    limits = pb.VerifierLimits(
        max_sessions=i.limits.max_sessions, max_context=i.limits.max_context,
        max_tree_nodes=i.limits.tree.max_nodes, max_tree_depth=i.limits.tree.max_depth,
    )
    return pb.VerifierInfo(
        model=i.model, dtype=i.dtype, device=i.device, vocab_size=i.vocab_size,
        eos_token_ids=i.eos_token_ids, target_layer_ids=i.target_layer_ids, limits=limits,
        cost=cost_to_pb(i.cost), memory=memory_to_pb(i.memory), row_invariant=i.row_invariant,
        decoder=i.decoder, weights=i.weights, attention_kernel=i.attention_kernel,
        self_draft_block=i.self_draft_block, prefill_chunk=i.prefill_chunk,
    )


def info_from_pb(msg: pb.VerifierInfo) -> VerifierInfo:
    lim = msg.limits
    tree = TreeLimits(lim.max_tree_nodes, lim.max_tree_depth, msg.vocab_size)
    return VerifierInfo(
        model=msg.model, dtype=msg.dtype, device=msg.device, vocab_size=msg.vocab_size,
        eos_token_ids=tuple(msg.eos_token_ids), target_layer_ids=tuple(msg.target_layer_ids),
        limits=VerifierLimits(lim.max_sessions, lim.max_context, tree),
        cost=cost_from_pb(msg.cost) if msg.HasField("cost") else None, memory=memory_from_pb(msg.memory),
        row_invariant=msg.row_invariant, decoder=msg.decoder, weights=msg.weights,
        attention_kernel=msg.attention_kernel, self_draft_block=msg.self_draft_block,
        prefill_chunk=msg.prefill_chunk,
    )
