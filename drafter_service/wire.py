"""``to_pb`` / ``from_pb`` for the drafter's own messages (``drafter.proto``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from presto_pb.v1 import common_pb2
from presto_pb.v1 import drafter_pb2 as pb
from presto_sd.engine.drafter import DraftCall, DrafterInfo, DraftResult
from presto_sd.engine.messages import EngineError, UnavailableError
from presto_sd.method.methods import DEFAULT_METHOD
from presto_sd.method.scores import DraftMarginals
from presto_sd.models.assets import DrafterDefaults
from presto_sd.rpc.wire import (
    answers_from_pb,
    delta_from_pb,
    delta_to_pb,
    item_error_fields,
    items_from_pb,
    memory_from_pb,
    memory_to_pb,
    round_context_from_pb,
    session_ref_from_pb,
    session_ref_to_pb,
    tensor_from_pb,
    tensor_to_pb,
    tree_from_pb,
    tree_params_from_pb,
    tree_params_to_pb,
    tree_to_pb,
)

NO_MARGINALS = DraftMarginals(torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1), torch.zeros(0))


def marginals_to_pb(m: DraftMarginals) -> pb.Marginals:
    msg = pb.Marginals(
        token_ids=tensor_to_pb(m.token_ids.long()), log_probs=tensor_to_pb(m.log_probs.float()),
        entropy=tensor_to_pb(m.entropy.float()),
    )
    if m.hidden is not None:
        msg.hidden.CopyFrom(tensor_to_pb(m.hidden.float()))
    return msg


def marginals_from_pb(msg: pb.Marginals) -> DraftMarginals:
    hidden = tensor_from_pb(msg.hidden, "marginals.hidden") if msg.HasField("hidden") else None
    return DraftMarginals(
        tensor_from_pb(msg.token_ids, "marginals.token_ids"),
        tensor_from_pb(msg.log_probs, "marginals.log_probs"),
        tensor_from_pb(msg.entropy, "marginals.entropy"),
        hidden,
    )


def draft_result_to_pb(r: DraftResult, want_marginals: bool) -> pb.DraftResponse:
    msg = pb.DraftResponse(
        tree=tree_to_pb(r.tree), path_scores=r.path_scores, forward_s=r.forward_s, build_s=r.build_s,
        node_log_acceptance=r.node_log_acceptance,
    )
    if want_marginals:
        msg.marginals.CopyFrom(marginals_to_pb(r.marginals))
    return msg


def draft_result_from_pb(msg: pb.DraftResponse) -> DraftResult:
    marginals = marginals_from_pb(msg.marginals) if msg.HasField("marginals") else NO_MARGINALS
    return DraftResult(
        tree=tree_from_pb(msg.tree), marginals=marginals, path_scores=tuple(msg.path_scores),
        forward_s=msg.forward_s, build_s=msg.build_s, node_log_acceptance=tuple(msg.node_log_acceptance),
    )


def draft_request_to_pb(c: DraftCall, want_marginals: bool) -> pb.DraftRequest:
    return pb.DraftRequest(session=session_ref_to_pb(c.session_id, c.base), anchor=c.anchor,
                           params=tree_params_to_pb(c.params, c.context, c.method),
                           want_marginals=want_marginals,
                           commit=None if c.commit is None else delta_to_pb(c.commit))


def draft_call_from_pb(msg: pb.DraftRequest) -> DraftCall:
    sid, base = session_ref_from_pb(msg.session)
    commit = delta_from_pb(msg.commit) if msg.HasField("commit") else None
    method = msg.params.method if msg.params.HasField("method") else DEFAULT_METHOD
    return DraftCall(sid, msg.anchor, base, method, tree_params_from_pb(msg.params), commit,
                     round_context_from_pb(msg.params))


def draft_calls_from_pb(msg: pb.DraftBatchRequest) -> list[DraftCall | EngineError]:
    return items_from_pb(msg.items, draft_call_from_pb)


def draft_batch_to_pb(
    answers: Sequence[DraftResult | EngineError], want_marginals: Sequence[bool]
) -> pb.DraftBatchResponse:
    return pb.DraftBatchResponse(items=[
        pb.DraftBatchItem(error=common_pb2.ItemError(**item_error_fields(a))) if isinstance(a, EngineError)
        else pb.DraftBatchItem(result=draft_result_to_pb(a, want))
        for a, want in zip(answers, want_marginals)])


def draft_batch_from_pb(
    msg: pb.DraftBatchResponse, unavailable: type[UnavailableError]
) -> list[DraftResult | EngineError]:
    return answers_from_pb(msg.items, draft_result_from_pb, unavailable)


def info_to_pb(i: DrafterInfo) -> pb.DrafterInfo:
    d = i.defaults
    return pb.DrafterInfo(
        block_size=i.block_size, target_layer_ids=i.target_layer_ids, mask_token_id=i.mask_token_id,
        vocab_size=i.vocab_size, methods=i.methods, rho_providers=i.rho_providers, name=i.name,
        default_rho=d.rho or "", default_lambdas=d.lambdas, max_sessions=i.max_sessions,
        lambdas_by_rho={rho: pb.Lambdas(values=lams) for rho, lams in d.lambdas_by_rho.items()},
        memory=memory_to_pb(i.memory),
    )


def info_from_pb(msg: pb.DrafterInfo) -> DrafterInfo:
    defaults = DrafterDefaults(
        rho=msg.default_rho or None, lambdas=tuple(msg.default_lambdas),
        lambdas_by_rho={rho: tuple(lams.values) for rho, lams in sorted(msg.lambdas_by_rho.items())},
    )
    return DrafterInfo(
        block_size=msg.block_size, target_layer_ids=tuple(msg.target_layer_ids),
        mask_token_id=msg.mask_token_id, vocab_size=msg.vocab_size, methods=tuple(msg.methods),
        rho_providers=tuple(msg.rho_providers), name=msg.name, defaults=defaults,
        max_sessions=msg.max_sessions, memory=memory_from_pb(msg.memory),
    )
