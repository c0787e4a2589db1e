"""``RemoteVerifier``: the ``Verifier`` interface over gRPC, so the loop runs unchanged.

Status codes come back as the named errors of ``presto_sd.engine.messages``; a server that is
away or too slow raises ``VerifierUnavailableError`` (the loop then waits and re-prefills).
"""

from __future__ import annotations

from collections.abc import Sequence

from presto_pb.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from presto_sd.engine.messages import EngineError, VerifierUnavailableError
from presto_sd.engine.verifier import (
    BatchAnswer,
    BatchCall,
    MaskChains,
    PrefillCall,
    PrefillResult,
    Verifier,
    VerifierInfo,
    VerifyCall,
    VerifyResult,
)
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.cost_model import CostFit
from presto_sd.method.tree import TokenTree
from presto_sd.rpc.client import ClientConfig, RpcClient
from presto_sd.rpc.errors import RemoteError
from presto_sd.rpc.wire import session_ref_to_pb
from verifier_service import wire


class RemoteVerifier(Verifier):
    def __init__(
        self,
        address: str,
        config: ClientConfig | None = None,
        timeout_s: float = 60.0,  # per call: a verify of the largest tree, with queueing
        prefill_timeout_s: float = 300.0,  # a long prompt
    ) -> None:
        self.rpc = RpcClient(address, config or ClientConfig(), VerifierUnavailableError)
        self.stub = verifier_pb2_grpc.VerifierServiceStub(self.rpc.channel)
        self.timeout_s, self.prefill_timeout_s = timeout_s, prefill_timeout_s
        self._info: VerifierInfo | None = None

    def info(self, fresh: bool = False) -> VerifierInfo:
        """The server's Info, fetched once (``fresh``: again, for its live cost model)."""
        if self._info is None or fresh:
            msg = self.rpc.call(self.stub.Info, common_pb2.InfoRequest(), self.timeout_s)
            self._info = wire.info_from_pb(msg)
        return self._info

    def cost_model(self) -> CostFit | None:
        return self.info(fresh=True).cost

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.info().eos_token_ids

    def prefill(
        self,
        session_id: str,
        token_ids: list[int],
        sampling: SamplingParams = SamplingParams(),
        anchor: int | None = None,
        restart: bool = False,
        decoded: int = 0,
    ) -> PrefillResult:
        call = PrefillCall(session_id, tuple(token_ids), sampling, anchor, restart, decoded)
        request = wire.prefill_call_to_pb(call)
        return wire.prefill_result_from_pb(self.rpc.call(self.stub.Prefill, request, self.prefill_timeout_s))

    def verify(
        self, session_id: str, base: int, tree: TokenTree, want_node_probs: bool = False,
        chains: MaskChains | None = None,
    ) -> VerifyResult:
        request = wire.verify_call_to_pb(VerifyCall(session_id, base, tree, want_node_probs, chains))
        return wire.verify_result_from_pb(self.rpc.call(self.stub.Verify, request, self.timeout_s))

    def verify_batch(self, calls: Sequence[BatchCall]) -> list[BatchAnswer]:
        """One ``VerifyBatch`` call; a failure of the whole call is every item's error."""
        if not calls:
            return []
        request = wire.verify_batch_request_to_pb(calls)
        try:
            msg = self.rpc.call(self.stub.VerifyBatch, request, self.prefill_timeout_s if any(
                isinstance(c, PrefillCall) for c in calls) else self.timeout_s)
        except EngineError as e:
            return [e] * len(calls)
        answers = wire.verify_batch_from_pb(msg, VerifierUnavailableError)
        if len(answers) != len(calls):
            error = RemoteError("INTERNAL", f"VerifyBatch: {len(answers)} answers to {len(calls)} items")
            return [error] * len(calls)
        # the wire's order (trees, then prompts) back to the caller's
        order = [j for j, c in enumerate(calls) if isinstance(c, VerifyCall)]
        order += [j for j, c in enumerate(calls) if isinstance(c, PrefillCall)]
        out: list[BatchAnswer] = [answers[0]] * len(calls)
        for j, a in zip(order, answers):
            out[j] = a
        return out

    def step(self, session_id: str, base: int, anchor: int) -> VerifyResult:
        request = verifier_pb2.StepRequest(session=session_ref_to_pb(session_id, base), anchor=anchor)
        return wire.verify_result_from_pb(self.rpc.call(self.stub.Step, request, self.timeout_s))

    def close(self, session_id: str) -> None:
        self.rpc.call(self.stub.Close, common_pb2.CloseRequest(session_id=session_id), self.timeout_s)

    def round_trip_s(self) -> float:
        return self.rpc.round_trip_s

    def shutdown(self) -> None:
        """Close the channel (the sessions stay until closed or expired)."""
        self.rpc.close()
