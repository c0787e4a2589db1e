"""The replica pools as one engine each: session affinity, calls split per replica (docs/design.md §3).

The step engine sees one ``Verifier`` and one ``Drafter``; behind them are pools of
replicas (actors of in-process engines, or clients of remote ones). Each session lives on
one replica of each pool (its home: the healthy replica holding the fewest sessions when
it first goes out). A batched call (``verify_batch``, ``draft_batch``) goes out as one
call per home replica, all at once, and the answers come back in the call's order; a
replica that does not answer fails only its own items (UNAVAILABLE). When a replica
fails, the next call re-homes its sessions on the healthiest other replica, where they
are unknown (NOT_FOUND), and the step engine rebuilds them as after any loss: the drafter
from the logged feature deltas, the verifier from the committed tokens with the pending
anchor (``presto_sd.loop.faults``).

Each pool also keeps, per session, the engine seconds its calls took since the last
chunk (``take_times``): the phases of a round in the metrics.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from orchestrator.metrics import Metrics
from orchestrator.replicas import Replica, ReplicaPool
from presto_sd.engine import calls
from presto_sd.engine.drafter import DraftCall, Drafter, DrafterInfo, DraftResult
from presto_sd.engine.messages import (
    EngineError,
    FeatureDelta,
    SessionNotFoundError,
    UnavailableError,
    copy_error,
)
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
    call_rows,
)
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.builders import RoundContext, TreeParams
from presto_sd.method.cost_model import CostFit
from presto_sd.method.tree import TokenTree


class _Pool:
    """Homes of sessions on one pool's replicas, and batched calls split by home."""

    kind = ""

    def __init__(self, pool: ReplicaPool, metrics: Metrics) -> None:
        self.pool, self.metrics = pool, metrics
        self.homes: dict[str, Replica] = {}
        self.held: dict[str, set[Replica]] = defaultdict(set)  # every replica that may hold it
        self.engine_s: dict[str, float] = defaultdict(float)  # per session, since take_times
        self._fan_out = ThreadPoolExecutor(max_workers=max(1, len(pool.replicas)),
                                           thread_name_prefix=f"{self.kind}-calls")

    def home(self, session_id: str) -> Replica:
        """The session's replica: where it lives while that one is healthy, else a new home."""
        with self.pool.lock:
            current = self.homes.get(session_id)
            if current is not None and current.healthy and current.mismatch is None:
                return current
            new = self.pool.pick()
            if current is not None and current.healthy and new.mismatch is not None:
                return current  # it differs, but nothing healthy computes alike: it stays
            if new is not current:
                if current is not None:
                    current.sessions.discard(session_id)
                    self.metrics.fallback(f"{self.kind}_rehome")
                    if new.mismatch is not None:  # no replica alike is healthy: served, not bitwise
                        self.metrics.fallback(f"{self.kind}_rehome_mismatch")
                new.sessions.add(session_id)
                self.homes[session_id] = new
                self.held[session_id].add(new)
                self._gauge()
            return new

    def take_times(self, session_id: str) -> float:
        """Engine seconds of the session's calls since the last take (kept past ``close``:
        a request's last chunk is delivered after its step closed its sessions)."""
        return self.engine_s.pop(session_id, 0.0)

    def round_trip_s(self) -> float:
        """The slowest healthy replica's link (``Replica.round_trip_s``): what a round pays."""
        links = [r.round_trip_s() for r in self.pool.replicas if r.healthy]
        return max(links, default=0.0)

    def close(self, session_id: str) -> None:
        """Close the session wherever it may live (old homes too); best effort."""
        held = self.held.pop(session_id, set())
        for replica in held:
            try:
                replica.call(calls.Close(session_id))
            except EngineError:
                pass
        with self.pool.lock:
            for replica in held:
                replica.sessions.discard(session_id)
            self.homes.pop(session_id, None)
            self._gauge()

    def batched(self, batch: type[calls.VerifyBatch | calls.DraftBatch], items: Sequence,
                on_call: Callable[[Replica, list, float], None]) -> list:
        """``batch`` over ``items``, one call per home replica at once; each item's answer
        (a replica that fails answers every item of its call with its error)."""
        groups: dict[Replica, list[int]] = defaultdict(list)
        for i, c in enumerate(items):
            groups[self.home(c.session_id)].append(i)
        out: list = [None] * len(items)

        def send(replica: Replica, indices: list[int]) -> None:
            sent = [items[i] for i in indices]
            try:
                outcome = replica.call(batch(tuple(sent)))
            except EngineError as e:  # the replica away: each item sees it
                for i in indices:
                    out[i] = copy_error(e)
                return
            away = next((a for a in outcome.value if isinstance(a, UnavailableError)), None)
            if away is not None:  # a remote engine that did not answer: its sessions re-home
                replica.failed(away.code)
            if any(isinstance(a, SessionNotFoundError) for a in outcome.value):
                replica.forgot_session()
            for i, answer in zip(indices, outcome.value):
                out[i] = answer
                if isinstance(answer, EngineError) and answer is not away:
                    self.metrics.error(self.kind, answer.code)
            for i in indices:  # a batch's engine time is each of its sessions' round's
                self.engine_s[items[i].session_id] += outcome.busy_s
            on_call(replica, sent, outcome.busy_s)

        if len(groups) == 1:
            send(*next(iter(groups.items())))
        else:
            for f in [self._fan_out.submit(send, r, indices) for r, indices in groups.items()]:
                f.result()
        return out

    def single(self, session_id: str, call: calls.EngineCall, timeout_s: float | None = None) -> Any:
        replica = self.home(session_id)
        outcome = replica.call(call, timeout_s=timeout_s)
        self.engine_s[session_id] += outcome.busy_s
        return outcome.value

    def _gauge(self) -> None:
        for r in self.pool.replicas:
            self.metrics.sessions(self.kind, r.name, len(r.sessions))

    def shutdown(self) -> None:
        self._fan_out.shutdown(wait=False)


class ReplicaMismatchError(ValueError):
    """Verifier replicas whose arithmetic differs (``VerifierInfo.arithmetic``): a session
    re-homed from one to another would not continue bitwise, so a pool refuses to form."""


def arithmetic_mismatch(infos: Sequence[tuple[str, VerifierInfo]]) -> str | None:
    """How the named verifiers' arithmetic differs from the first's, or None where it agrees."""
    (first, want), *rest = [(name, info.arithmetic()) for name, info in infos]
    for name, got in rest:
        if differ := [f"{k} {got[k]!r} (not {want[k]!r})" for k in want if got[k] != want[k]]:
            return (f"verifier replica {name} differs from {first}: {', '.join(differ)}. A session "
                    "re-homed between them (a replica down) would not continue bitwise: run every "
                    "verifier replica with the same target, dtype, weights, decoder and prefill chunk")
    return None


class PooledVerifier(_Pool, Verifier):
    kind = "verifier"

    def __init__(self, pool: ReplicaPool, metrics: Metrics) -> None:
        super().__init__(pool, metrics)
        self._prefilled: set[str] = set()
        self._lock = threading.Lock()

    def info(self) -> VerifierInfo:
        return self.pool.pick().call(calls.Info()).value

    def check_arithmetic(self) -> None:
        """Raise ``ReplicaMismatchError`` unless every replica computes as the first. Asked when
        the pool forms, and of a replica again whenever it comes back from a failure or
        forgets a session (it may have restarted with other settings): one that differs then
        is named (``Replica.mismatch``) and gets sessions only while none alike is healthy."""
        infos = [(r.name, r.call(calls.Info()).value) for r in self.pool.replicas]
        if (mismatch := arithmetic_mismatch(infos)) is not None:
            raise ReplicaMismatchError(mismatch)
        reference = infos[0]

        def agrees(replica: Replica, timeout_s: float) -> str | None:
            outcome = replica.engine.call(calls.Info(), timeout_s=timeout_s)
            if outcome.error is not None:
                raise outcome.error
            return arithmetic_mismatch([reference, (replica.name, outcome.value)])

        for replica in self.pool.replicas:
            replica.check = agrees

    def cost_model(self) -> CostFit | None:
        return self.info().cost

    def calibrate_cost(self) -> CostFit | None:
        """TAPS's cost model: a replica's own (an in-process verifier measures its forwards)."""
        replica = self.pool.pick()
        return replica.call(calls.CalibrateCost(), timeout_s=replica.timeouts.prefill_s).value

    def max_context(self) -> int:
        """The smallest window of the healthy replicas, asked once per replica (it is fixed
        when it loads)."""
        windows = []
        for replica in [r for r in self.pool.replicas if r.healthy] or [self.pool.pick()]:
            if replica.max_context is None:
                replica.max_context = replica.call(calls.MaxContext()).value
            windows.append(replica.max_context)
        return min(windows)

    def prefill(self, session_id: str, token_ids: list[int], sampling: SamplingParams = SamplingParams(),
                anchor: int | None = None, restart: bool = False, decoded: int = 0) -> PrefillResult:
        """A long prompt, alone (its engine prefills it in chunks)."""
        self._count_prefill(session_id)
        replica = self.home(session_id)
        call = PrefillCall(session_id, tuple(token_ids), sampling, anchor, restart, decoded)
        out = self.single(session_id, calls.Prefill(call), timeout_s=replica.timeouts.prefill_s)
        self.metrics.batch(replica.name, 1, len(token_ids), 0.0, 1)
        return out

    def verify(self, session_id: str, base: int, tree: TokenTree,
               want_node_probs: bool = False, chains: MaskChains | None = None) -> VerifyResult:
        answer = self.verify_batch([VerifyCall(session_id, base, tree, want_node_probs, chains)])[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def verify_batch(self, items: Sequence[BatchCall]) -> list[BatchAnswer]:
        for c in items:
            if isinstance(c, PrefillCall):
                self._count_prefill(c.session_id)
        return self.batched(calls.VerifyBatch, items, self._on_batch)

    def _on_batch(self, replica: Replica, sent: list, busy_s: float) -> None:
        prompts = sum(1 for c in sent if isinstance(c, PrefillCall))
        tokens = sum(call_rows(c) for c in sent)
        self.metrics.batch(replica.name, len(sent), tokens, busy_s, prompts)

    def _count_prefill(self, session_id: str) -> None:
        with self._lock:
            if session_id in self._prefilled:
                self.metrics.fallback("verifier_reprefill")
            self._prefilled.add(session_id)

    def close(self, session_id: str) -> None:
        super().close(session_id)
        with self._lock:
            self._prefilled.discard(session_id)


class PooledDrafter(_Pool, Drafter):
    kind = "drafter"

    def info(self) -> DrafterInfo:
        return self.pool.pick().call(calls.Info()).value

    def prefill(self, session_id: str, delta: FeatureDelta, restart: bool = False) -> int:
        replica = self.home(session_id)
        return self.single(session_id, calls.DrafterPrefill(session_id, delta, restart),
                           timeout_s=replica.timeouts.prefill_s)

    def draft(self, session_id: str, anchor: int, base: int, method: str, params: TreeParams,
              context: RoundContext = RoundContext()) -> DraftResult:
        answer = self.draft_batch([DraftCall(session_id, anchor, base, method, params, context=context)])[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def draft_batch(self, items: Sequence[DraftCall]) -> list[DraftResult | EngineError]:
        return self.batched(calls.DraftBatch, items,
                            lambda replica, sent, busy_s: self.metrics.draft_batch(replica.name, len(sent)))

    def commit(self, session_id: str, delta: FeatureDelta) -> int:
        return self.single(session_id, calls.Commit(session_id, delta))
