"""``VerifierService`` over gRPC: thin ``from_pb -> engine -> to_pb`` adapters.

Errors become status codes in the server's one interceptor (``presto_sd.rpc.server``).
Session ids are keyed by the caller's principal (``EngineHost.session_key``); a call
whose response could pass the message limit is refused before it runs (``wire``'s bounds).
Sizes (prompt tokens, tree nodes, batch items) are checked against the engine's limits
before anything is built from a request: an oversized one is refused at once.
"""

from __future__ import annotations

from dataclasses import replace

import grpc

from presto_pb.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from presto_sd.engine import calls
from presto_sd.engine.messages import EngineError, LimitExceededError
from presto_sd.engine.verifier import VerifierLimits, VerifyCall
from presto_sd.method.tree import TokenTree
from presto_sd.rpc.server import EngineHost
from presto_sd.rpc.wire import session_id_from, session_ref_from_pb, tree_from_pb
from verifier_service import wire

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name
add_to_server = verifier_pb2_grpc.add_VerifierServiceServicer_to_server


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer, EngineHost):
    def __init__(self) -> None:
        EngineHost.__init__(self, "verifier")

    def _row_bytes(self) -> int:
        return self.ready().feature_row_bytes

    def limits(self) -> VerifierLimits:
        return self.ready().info().limits

    async def Prefill(self, request, context: grpc.aio.ServicerContext):
        n, max_context = len(request.token_ids), self.limits().max_context
        if n + 1 > max_context:  # the engine's rule, before the list is built
            raise LimitExceededError(f"prefill: {n} tokens exceed max_context {max_context}")
        call = wire.prefill_call_from_pb(request)
        sid, tokens = self.session_key(call.session_id), list(call.token_ids)
        self.check_response(wire.prefill_response_bound(len(tokens), self._row_bytes()), "prefill")
        res = await self.run_steps(context, calls.Prefill(replace(call, session_id=sid)))
        return wire.prefill_result_to_pb(res)

    async def Verify(self, request, context: grpc.aio.ServicerContext):
        sid, base = session_ref_from_pb(request.session)
        tree = tree_from_pb(request.tree, max_nodes=self.limits().tree.max_nodes)
        call = VerifyCall(self.session_key(sid), base, tree, request.want_node_probs)
        self.check_response(wire.verify_response_bound(call, self._row_bytes()), "verify")
        res = await self.run(context, calls.Verify(call))
        return wire.verify_result_to_pb(res)

    async def VerifyBatch(self, request, context: grpc.aio.ServicerContext):
        limits = self.limits()
        n = len(request.items) + len(request.prefills)
        if n > limits.max_sessions:  # items name distinct sessions
            raise LimitExceededError(
                f"verify_batch: {n} items, more than the {limits.max_sessions} sessions this verifier holds")
        items = [c if isinstance(c, EngineError) else replace(c, session_id=self.session_key(c.session_id))
                 for c in wire.verify_calls_from_pb(request, limits.tree.max_nodes)]  # malformed: own error
        valid = tuple(c for c in items if not isinstance(c, EngineError))
        row = self._row_bytes()
        bound = sum(wire.verify_response_bound(c, row) if isinstance(c, VerifyCall)
                    else wire.prefill_response_bound(len(c.token_ids), row) for c in valid)
        self.check_response(bound + wire.ITEM_ERROR_BOUND * len(items), "verify_batch")
        results = iter(await self.run(context, calls.VerifyBatch(valid)))
        answers = [c if isinstance(c, EngineError) else next(results) for c in items]
        return wire.verify_batch_to_pb(answers, len(request.items))

    async def Step(self, request, context: grpc.aio.ServicerContext):
        sid, base = session_ref_from_pb(request.session)
        step = VerifyCall(self.session_key(sid), base, TokenTree.root_only(request.anchor))
        self.check_response(wire.verify_response_bound(step, self._row_bytes()), "step")
        res = await self.run(context, calls.Step(step.session_id, base, request.anchor))
        return wire.verify_result_to_pb(res)

    async def Close(self, request, context: grpc.aio.ServicerContext):
        await self.run(context, calls.Close(self.session_key(session_id_from(request.session_id))))
        return common_pb2.CloseResponse()

    async def Info(self, request, context: grpc.aio.ServicerContext):
        return wire.info_to_pb(self.ready().info())
