"""``RemoteDrafter``: the ``Drafter`` interface over gRPC, so the loop runs unchanged.

Status codes come back as the named errors of ``presto_sd.engine.messages``; a server that is
away or too slow raises ``DrafterUnavailableError`` (the loop then takes AR steps).
"""

from __future__ import annotations

from collections.abc import Sequence

from drafter_service import wire
from presto_pb.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from presto_sd.engine.drafter import DraftCall, Drafter, DrafterInfo, DraftResult
from presto_sd.engine.messages import DrafterUnavailableError, EngineError, FeatureDelta
from presto_sd.method.builders import RoundContext, TreeParams
from presto_sd.rpc.client import ClientConfig, RpcClient
from presto_sd.rpc.errors import RemoteError
from presto_sd.rpc.wire import delta_to_pb, session_ref_to_pb


class RemoteDrafter(Drafter):
    def __init__(
        self,
        address: str,
        config: ClientConfig | None = None,
        timeout_s: float = 10.0,  # past this a round goes on without a tree
        prefill_timeout_s: float = 120.0,
        want_marginals: bool = False,  # ship the top-K marginals back (traces, h_phi)
    ) -> None:
        self.rpc = RpcClient(address, config or ClientConfig(), DrafterUnavailableError)
        self.stub = drafter_pb2_grpc.DrafterServiceStub(self.rpc.channel)
        self.timeout_s, self.prefill_timeout_s = timeout_s, prefill_timeout_s
        self.want_marginals = want_marginals
        self._info: DrafterInfo | None = None

    def info(self) -> DrafterInfo:
        if self._info is None:
            msg = self.rpc.call(self.stub.Info, common_pb2.InfoRequest(), self.timeout_s)
            self._info = wire.info_from_pb(msg)
        return self._info

    def prefill(self, session_id: str, delta: FeatureDelta, restart: bool = False) -> int:
        request = drafter_pb2.DrafterPrefillRequest(session_id=session_id, delta=delta_to_pb(delta),
                                                    restart=restart)
        return self.rpc.call(self.stub.Prefill, request, self.prefill_timeout_s).base

    def draft(self, session_id: str, anchor: int, base: int, method: str, params: TreeParams,
              context: RoundContext = RoundContext()) -> DraftResult:
        call = DraftCall(session_id, anchor, base, method, params, context=context)
        request = wire.draft_request_to_pb(call, self.want_marginals)
        return wire.draft_result_from_pb(self.rpc.call(self.stub.Draft, request, self.timeout_s))

    def commit_and_draft(self, session_id: str, delta: FeatureDelta, anchor: int, base: int, method: str,
                         params: TreeParams, context: RoundContext = RoundContext()) -> DraftResult:
        """One ``Draft`` call carrying the commit: one round trip for both."""
        call = DraftCall(session_id, anchor, base, method, params, commit=delta, context=context)
        request = wire.draft_request_to_pb(call, self.want_marginals)
        return wire.draft_result_from_pb(self.rpc.call(self.stub.Draft, request, self.timeout_s))

    def draft_batch(self, calls: Sequence[DraftCall]) -> list[DraftResult | EngineError]:
        """One ``DraftBatch`` call; a failure of the whole call is every item's error."""
        if not calls:
            return []
        request = drafter_pb2.DraftBatchRequest(
            items=[wire.draft_request_to_pb(c, self.want_marginals) for c in calls])
        try:
            msg = self.rpc.call(self.stub.DraftBatch, request, self.timeout_s)
        except EngineError as e:
            return [e] * len(calls)
        answers = wire.draft_batch_from_pb(msg, DrafterUnavailableError)
        if len(answers) != len(calls):
            error = RemoteError("INTERNAL", f"DraftBatch: {len(answers)} answers to {len(calls)} items")
            return [error] * len(calls)
        return answers

    def commit(self, session_id: str, delta: FeatureDelta) -> int:
        request = drafter_pb2.CommitRequest(
            session=session_ref_to_pb(session_id, delta.start), delta=delta_to_pb(delta)
        )
        return self.rpc.call(self.stub.Commit, request, self.timeout_s).base

    def close(self, session_id: str) -> None:
        self.rpc.call(self.stub.Close, common_pb2.CloseRequest(session_id=session_id), self.timeout_s)

    def round_trip_s(self) -> float:
        return self.rpc.round_trip_s

    def shutdown(self) -> None:
        """Close the channel (the sessions stay until closed or expired)."""
        self.rpc.close()
