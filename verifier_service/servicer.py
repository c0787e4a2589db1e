"""``VerifierService`` over gRPC: thin ``from_pb -> engine -> to_pb`` adapters.

Errors become status codes in the server's one interceptor (``presto_sd.rpc.server``).
"""

from __future__ import annotations

import grpc

from presto_pb.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from presto_sd.engine.messages import EngineError
from presto_sd.engine.verifier import VerifyCall
from presto_sd.method.acceptance import SamplingParams
from presto_sd.rpc.server import EngineHost
from presto_sd.rpc.wire import sampling_from_pb, session_id_from, session_ref_from_pb, tree_from_pb
from verifier_service import wire

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name
add_to_server = verifier_pb2_grpc.add_VerifierServiceServicer_to_server


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer, EngineHost):
    def __init__(self) -> None:
        EngineHost.__init__(self, "verifier")

    async def Prefill(self, request, context: grpc.aio.ServicerContext):
        sid = session_id_from(request.session_id)
        sampling = sampling_from_pb(request.sampling) if request.HasField("sampling") else SamplingParams()
        anchor = request.anchor if request.HasField("anchor") else None
        res = await self.run(context, "prefill", sid, list(request.token_ids), sampling, anchor)
        return wire.prefill_result_to_pb(res)

    async def Verify(self, request, context: grpc.aio.ServicerContext):
        sid, base = session_ref_from_pb(request.session)
        tree = tree_from_pb(request.tree)
        res = await self.run(context, "verify", sid, base, tree, request.want_node_probs)
        return wire.verify_result_to_pb(res)

    async def VerifyBatch(self, request, context: grpc.aio.ServicerContext):
        items = wire.verify_calls_from_pb(request)  # a malformed item: its own error
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

