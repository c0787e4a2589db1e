"""``VerifierService`` over gRPC: thin ``from_pb -> engine -> to_pb`` adapters.

Errors become status codes in the server's one interceptor (``presto_sd.rpc.server``).
Sizes (prompt tokens, tree nodes, batch items) are checked against the engine's limits
before anything is built from a request: an oversized one is refused at once.
"""

from __future__ import annotations

import grpc

from presto_pb.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from presto_sd.engine.messages import EngineError, LimitExceededError
from presto_sd.engine.verifier import VerifierLimits, VerifyCall
from presto_sd.method.acceptance import SamplingParams
from presto_sd.rpc.server import EngineHost
from presto_sd.rpc.wire import sampling_from_pb, session_id_from, session_ref_from_pb, tree_from_pb
from verifier_service import wire

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name
add_to_server = verifier_pb2_grpc.add_VerifierServiceServicer_to_server


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer, EngineHost):
    def __init__(self) -> None:
        EngineHost.__init__(self, "verifier")

    def limits(self) -> VerifierLimits:
        return self.ready().info().limits

    async def Prefill(self, request, context: grpc.aio.ServicerContext):
        n, max_context = len(request.token_ids), self.limits().max_context
        if n + 1 > max_context:  # the engine's rule, before the list is built
            raise LimitExceededError(f"prefill: {n} tokens exceed max_context {max_context}")
        sid = session_id_from(request.session_id)
        sampling = sampling_from_pb(request.sampling) if request.HasField("sampling") else SamplingParams()
        anchor = request.anchor if request.HasField("anchor") else None
        res = await self.run(context, "prefill", sid, list(request.token_ids), sampling, anchor)
        return wire.prefill_result_to_pb(res)

    async def Verify(self, request, context: grpc.aio.ServicerContext):
        sid, base = session_ref_from_pb(request.session)
        tree = tree_from_pb(request.tree, max_nodes=self.limits().tree.max_nodes)
        res = await self.run(context, "verify", sid, base, tree, request.want_node_probs)
        return wire.verify_result_to_pb(res)

    async def VerifyBatch(self, request, context: grpc.aio.ServicerContext):
        limits = self.limits()
        if len(request.items) > limits.max_sessions:  # items name distinct sessions
            raise LimitExceededError(
                f"verify_batch: {len(request.items)} items, more than the {limits.max_sessions} sessions "
                "this verifier holds")
        items = wire.verify_calls_from_pb(request, limits.tree.max_nodes)  # a malformed item: its own error
        calls = [c for c in items if isinstance(c, VerifyCall)]
        results = iter(await self.run(context, "verify_batch", calls))
        return wire.verify_batch_to_pb([c if isinstance(c, EngineError) else next(results) for c in items])

    async def Step(self, request, context: grpc.aio.ServicerContext):
        sid, base = session_ref_from_pb(request.session)
        return wire.verify_result_to_pb(await self.run(context, "step", sid, base, request.anchor))

    async def Close(self, request, context: grpc.aio.ServicerContext):
        await self.run(context, "close", session_id_from(request.session_id))
        return common_pb2.CloseResponse()

    async def Info(self, request, context: grpc.aio.ServicerContext):
        return wire.info_to_pb(self.ready().info())

