"""``DrafterService`` over gRPC: thin ``from_pb -> engine -> to_pb`` adapters.

Errors become status codes in the server's one interceptor (``presto_sd.rpc.server``).
"""

from __future__ import annotations

from dataclasses import replace

import grpc
import torch

from drafter_service import wire
from presto_pb.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from presto_sd.engine.drafter import DrafterInfo
from presto_sd.engine.messages import InvalidArgumentError
from presto_sd.rpc.server import EngineHost
from presto_sd.rpc.wire import delta_from_pb, session_id_from, session_ref_from_pb, tree_params_from_pb

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name
add_to_server = drafter_pb2_grpc.add_DrafterServiceServicer_to_server


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer, EngineHost):
    def __init__(self, info_overrides: dict | None = None) -> None:
        EngineHost.__init__(self, "drafter")
        self.info_overrides = info_overrides or {}  # name, PRESTO defaults shipped with it

    async def Prefill(self, request, context: grpc.aio.ServicerContext):
        sid = session_id_from(request.session_id)
        base = await self.run(context, "prefill", sid, delta_from_pb(request.delta))
        return drafter_pb2.DrafterPrefillResponse(base=base)

    async def Draft(self, request, context: grpc.aio.ServicerContext):
        sid, base = session_ref_from_pb(request.session)
        params = tree_params_from_pb(request.params)
        res = await self.run(context, "draft", sid, request.anchor, base, params)
        return wire.draft_result_to_pb(res, request.want_marginals)

    async def Commit(self, request, context: grpc.aio.ServicerContext):
        sid, base = session_ref_from_pb(request.session)
        delta = delta_from_pb(request.delta)
        if delta.start != base:
            raise InvalidArgumentError(f"delta.start = {delta.start}: must equal session.base = {base}")
        return drafter_pb2.CommitResponse(base=await self.run(context, "commit", sid, delta))

    async def Close(self, request, context: grpc.aio.ServicerContext):
        await self.run(context, "close", session_id_from(request.session_id))
        return common_pb2.CloseResponse()

    async def Info(self, request, context: grpc.aio.ServicerContext):
        info: DrafterInfo = replace(self.ready().info(), **self.info_overrides)
        return wire.info_to_pb(info)


def load_drafter(target: str | None, drafter: str | None, max_sessions: int = 256,
                 dtype: torch.dtype | None = None):
    """A ``DFlashDrafter`` with the target's embeddings and lm_head (the rest of the target
    is dropped), and the drafter's shipped PRESTO defaults for ``Info``."""
    from presto_sd.embedded.dflash_drafter import DFlashDrafter
    from presto_sd.embedded.stack import rho_providers_from
    from presto_sd.models.loading import load_drafter_model, load_target, read_json, resolve_drafter

    model, _ = load_target(target, dtype=dtype)
    spec = resolve_drafter(drafter, target)
    draft_model = load_drafter_model(spec, model)
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    del model  # the decoder layers are the verifier's business
    engine = DFlashDrafter(draft_model, embed, head, rho_providers_from(spec.path, embed),
                           max_sessions=max_sessions)
    overrides: dict = {"name": str(spec.path) if spec.path else "random"}
    if spec.path is not None and (spec.path / "presto.json").exists():
        presto = read_json(spec.path / "presto.json")
        overrides["default_rho"] = presto.get("rho")
        overrides["default_lambdas"] = tuple(float(x) for x in presto.get("lambdas", ()))
    return engine, overrides
