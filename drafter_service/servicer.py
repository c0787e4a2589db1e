"""``DrafterService`` over gRPC: thin ``from_pb -> engine -> to_pb`` adapters.

Errors become status codes in the server's one interceptor (``presto_sd.rpc.server``).
Session ids are keyed by the caller's principal (``EngineHost.session_key``). No drafter
call changes a session and answers more than a few bytes (a Draft changes nothing), so
none needs the verifier's response bounds.
"""

from __future__ import annotations

from dataclasses import replace

import grpc

from drafter_service import wire
from presto_pb.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from presto_sd.engine import calls
from presto_sd.engine.messages import EngineError, InvalidArgumentError
from presto_sd.rpc.decoding import off_loop
from presto_sd.rpc.server import EngineHost
from presto_sd.rpc.wire import delta_from_pb, session_id_from, session_ref_from_pb

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name
add_to_server = drafter_pb2_grpc.add_DrafterServiceServicer_to_server


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer, EngineHost):
    def __init__(self) -> None:
        EngineHost.__init__(self, "drafter")

    async def Prefill(self, request, context: grpc.aio.ServicerContext):
        sid = self.session_key(session_id_from(request.session_id))
        delta = await off_loop(request.delta.ByteSize(), delta_from_pb, request.delta)  # a prompt's features
        base = await self.run(context, calls.DrafterPrefill(sid, delta, request.restart))
        return drafter_pb2.DrafterPrefillResponse(base=base)

    async def Draft(self, request, context: grpc.aio.ServicerContext):
        c = await off_loop(request.commit.ByteSize(), wire.draft_call_from_pb, request)  # a commit's features
        res = await self.run(context, calls.Draft(replace(c, session_id=self.session_key(c.session_id))))
        return wire.draft_result_to_pb(res, request.want_marginals)

    async def DraftBatch(self, request, context: grpc.aio.ServicerContext):
        items = [c if isinstance(c, EngineError) else replace(c, session_id=self.session_key(c.session_id))
                 for c in wire.draft_calls_from_pb(request)]  # a malformed item: its own error
        valid = tuple(c for c in items if not isinstance(c, EngineError))
        results = iter(await self.run(context, calls.DraftBatch(valid)))
        answers = [c if isinstance(c, EngineError) else next(results) for c in items]
        return wire.draft_batch_to_pb(answers, [item.want_marginals for item in request.items])

    async def Commit(self, request, context: grpc.aio.ServicerContext):
        sid, base = session_ref_from_pb(request.session)
        delta = await off_loop(request.delta.ByteSize(), delta_from_pb, request.delta)
        if delta.start != base:
            raise InvalidArgumentError(f"delta.start = {delta.start}: must equal session.base = {base}")
        base = await self.run(context, calls.Commit(self.session_key(sid), delta))
        return drafter_pb2.CommitResponse(base=base)

    async def Close(self, request, context: grpc.aio.ServicerContext):
        await self.run(context, calls.Close(self.session_key(session_id_from(request.session_id))))
        return common_pb2.CloseResponse()

    async def Info(self, request, context: grpc.aio.ServicerContext):
        return wire.info_to_pb(self.ready().info())  # its name and fitted PRESTO defaults included

