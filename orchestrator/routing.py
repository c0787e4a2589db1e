"""Session affinity: each request's engines, routed to the replicas holding its sessions (docs/design.md §3).

- Each request holds its drafter and verifier sessions on one replica each (its
  ``Route``). ``RoutedDrafter`` / ``RoutedVerifier`` implement the engine interfaces for
  that request, so ``stream_generate`` and the fault links of ``faults.py`` run unchanged
  on top: the feature delta the verifier returns goes, through ``DrafterLink``, to the
  drafter replica that holds the session. When a replica fails, the next call re-homes
  the session on the healthiest other replica, where it is unknown (NOT_FOUND), and the
  links rebuild it: the drafter from the logged feature deltas, the verifier from the
  committed tokens with the pending anchor.
- Draft and verify calls go through the replica's ``Batcher`` (``batching.py``); replicas
  and their health are ``replicas.py``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from orchestrator.batching import Batcher
from orchestrator.metrics import Metrics
from orchestrator.replicas import Replica, ReplicaPool
from presto_sd.engine.drafter import DraftCall, Drafter, DrafterInfo, DraftResult
from presto_sd.engine.messages import EngineError, FeatureDelta
from presto_sd.engine.verifier import (
    PrefillCall,
    PrefillResult,
    Verifier,
    VerifierInfo,
    VerifyCall,
    VerifyResult,
)
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.batch_cost import SharedForward
from presto_sd.method.builders import TreeParams
from presto_sd.method.tree import TokenTree


@dataclass
class Route:
    """Where one request's sessions live, and its engine time since the last chunk."""

    session_id: str  # the request's session id on the engines
    drafter: Replica | None = None
    verifier: Replica | None = None
    held: set[Replica] = field(default_factory=set)  # every replica that may hold one of its sessions
    drafter_s: float = 0.0  # drafter engine seconds (draft + commit)
    verifier_s: float = 0.0  # verifier engine seconds (the whole batch this request was in)
    queue_s: float = 0.0  # waiting for the verifier replica to be free

    def take_times(self) -> tuple[float, float, float]:
        times = (self.drafter_s, self.verifier_s, self.queue_s)
        self.drafter_s = self.verifier_s = self.queue_s = 0.0
        return times


class _Routed:
    """Session affinity for one request on one pool: stay, or move when the replica failed."""

    kind = ""

    def __init__(self, pool: ReplicaPool, route: Route, metrics: Metrics,
                 batchers: dict[Replica, Batcher]) -> None:
        self.pool, self.route, self.metrics, self.batchers = pool, route, metrics, batchers

    def _home(self) -> Replica:
        with self.pool.lock:
            current: Replica | None = getattr(self.route, self.kind)
            if current is not None and current.healthy:
                return current
            new = self.pool.pick()
            if new is not current:
                if current is not None:
                    current.sessions.discard(self.route.session_id)
                    self.metrics.fallback(f"{self.kind}_rehome")
                new.sessions.add(self.route.session_id)
                setattr(self.route, self.kind, new)
                self.route.held.add(new)
                self._gauge()
            return new

    def round_trip_s(self) -> float:
        """The home replica's link (``Replica.round_trip_s``)."""
        return self._home().round_trip_s()

    def close(self, session_id: str) -> None:
        """Close the session wherever it may live (the old homes too); best effort."""
        mine = [r for r in self.route.held if r.kind == self.kind]
        for replica in mine:
            try:
                replica.call("close", session_id)
            except EngineError:
                pass
        with self.pool.lock:
            for replica in mine:
                replica.sessions.discard(self.route.session_id)
            self._gauge()

    def _gauge(self) -> None:
        for r in self.pool.replicas:
            self.metrics.sessions(self.kind, r.name, len(r.sessions))


class RoutedDrafter(_Routed, Drafter):
    kind = "drafter"

    def _call(self, method: str, *args: Any) -> Any:
        replica = self._home()
        timeout_s = replica.timeouts.prefill_s if method == "prefill" else None
        with self._away():
            out = replica.call(method, *args, timeout_s=timeout_s)
        self.route.drafter_s += out.busy_s
        return out.value

    @contextlib.contextmanager
    def _away(self) -> Iterator[None]:
        """While this request is at its drafter, its verifier's batches do not wait for it."""
        batcher = self.batchers.get(self.route.verifier) if self.route.verifier is not None else None
        if batcher is None:
            yield
            return
        batcher.away(self.route.session_id, True)
        try:
            yield
        finally:
            batcher.away(self.route.session_id, False)

    def info(self) -> DrafterInfo:
        return self._call("info")

    def prefill(self, session_id: str, delta: FeatureDelta, restart: bool = False) -> int:
        return self._call("prefill", session_id, delta, restart)

    def draft(self, session_id: str, anchor: int, base: int, params: TreeParams) -> DraftResult:
        return self._draft(DraftCall(session_id, anchor, base, params))

    def commit_and_draft(self, session_id: str, delta: FeatureDelta, anchor: int, base: int,
                         params: TreeParams) -> DraftResult:
        return self._draft(DraftCall(session_id, anchor, base, params, commit=delta))

    def _draft(self, call: DraftCall) -> DraftResult:
        with self._away():
            res, busy_s, _ = self.batchers[self._home()].submit(call).result()
        self.route.drafter_s += busy_s
        if isinstance(res, BaseException):
            raise res
        return res

    def commit(self, session_id: str, delta: FeatureDelta) -> int:
        return self._call("commit", session_id, delta)


class RoutedVerifier(_Routed, Verifier):
    kind = "verifier"

    def __init__(self, pool: ReplicaPool, route: Route, metrics: Metrics,
                 batchers: dict[Replica, Batcher]) -> None:
        super().__init__(pool, route, metrics, batchers)
        self._prefills = 0

    def info(self) -> VerifierInfo:
        return self._home().call("info").value

    def max_context(self) -> int:
        """The home replica's window, asked once per replica (it is fixed when it loads)."""
        replica = self._home()
        if replica.max_context is None:
            replica.max_context = replica.call("max_context").value
        return replica.max_context

    def prefill(self, session_id: str, token_ids: list[int], sampling: SamplingParams = SamplingParams(),
                anchor: int | None = None, restart: bool = False) -> PrefillResult:
        replica = self._home()
        if self._prefills:
            self.metrics.fallback("verifier_reprefill")
        self._prefills += 1
        if self.batchers[replica].takes_prompt(len(token_ids)):  # rides in a batch with others' steps
            call = PrefillCall(session_id, tuple(token_ids), sampling, anchor, restart)
            return self._batched(replica, call)
        out = replica.call("prefill", session_id, token_ids, sampling, anchor, restart,
                           timeout_s=replica.timeouts.prefill_s)
        self.route.verifier_s += out.busy_s
        return out.value

    def verify(
        self, session_id: str, base: int, tree: TokenTree, want_node_probs: bool = False
    ) -> VerifyResult:
        return self._batched(self._home(), VerifyCall(session_id, base, tree, want_node_probs))

    def _batched(self, replica: Replica, call: VerifyCall | PrefillCall) -> Any:
        """``call``'s answer from the replica's next batch (its error raised)."""
        res, busy_s, queue_s = self.batchers[replica].submit(call).result()
        self.route.verifier_s += busy_s
        self.route.queue_s += queue_s
        if isinstance(res, BaseException):
            raise res
        return res

    def shared_forward(self, rows: int) -> SharedForward | None:
        """The replica's last batch without this request's ``rows``: the load its tree joins.

        The other rows' tokens per step are counted as one per other request (an AR step
        commits one; a tree's round commits its tau, so this errs toward smaller trees).
        """
        batcher = self.batchers[self._home()]
        others = batcher.last_calls - 1
        load = batcher.last_tokens - rows
        if others < 1 or load < 1:
            return None
        if batcher.cost_curve.prior is None:
            batcher.cost_curve.prior = self.cost_model()  # shapes the sizes not seen yet
        fit = batcher.cost_curve.shared_fit(load)
        return None if fit is None else SharedForward(fit, float(others))

    def calibrate_cost(self):
        """TAPS's cost model: the replica's own (an in-process verifier measures its forwards)."""
        return self._home().call("calibrate_cost", timeout_s=self.pool.replicas[0].timeouts.prefill_s).value
