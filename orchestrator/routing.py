"""Replicas, session affinity and continuous batching (docs/design.md §3).

- A ``Replica`` is the driver's handle on one engine actor: calls with a deadline, the
  engine's named errors re-raised, and a health backoff after it fails (unreachable, dead,
  too slow).
- Each request holds its drafter and verifier sessions on one replica each (its
  ``Route``). ``RoutedDrafter`` / ``RoutedVerifier`` implement the engine interfaces for
  that request, so ``stream_generate`` and the fault links of ``faults.py`` run unchanged
  on top: the feature delta the verifier returns goes, through ``DrafterLink``, to the
  drafter replica that holds the session. When a replica fails, the next call re-homes
  the session on the healthiest other replica, where it is unknown (NOT_FOUND), and the
  links rebuild it: the drafter from the logged feature deltas, the verifier from the
  committed tokens with the pending anchor.
- ``VerifyBatcher``: per verifier replica, whatever verify calls are queued when the
  replica is free go out as ONE ``verify_batch`` (continuous batching); requests not in
  the batch draft meanwhile on the drafter replicas.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from orchestrator.actors import Outcome, ReplicaSpec
from orchestrator.metrics import Metrics
from presto_sd.engine.drafter import Drafter, DrafterInfo, DraftResult
from presto_sd.engine.messages import (
    DrafterUnavailableError,
    EngineError,
    FeatureDelta,
    UnavailableError,
    VerifierUnavailableError,
)
from presto_sd.engine.verifier import PrefillResult, Verifier, VerifierInfo, VerifyCall, VerifyResult
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.builders import TreeParams
from presto_sd.method.tree import TokenTree


@dataclass(frozen=True)
class Timeouts:
    drafter_s: float = 30.0  # past this a round goes on without a tree
    verifier_s: float = 120.0  # a verify batch, with the queue in front of it
    prefill_s: float = 300.0
    retry_s: float = 0.5  # a failed replica is skipped this long, doubling up to retry_max_s
    retry_max_s: float = 8.0


class Replica:
    def __init__(self, spec: ReplicaSpec, actor: Any, timeouts: Timeouts, metrics: Metrics) -> None:
        self.kind, self.name, self.actor = spec.kind, spec.name, actor
        self.timeouts, self.metrics = timeouts, metrics
        self.unavailable = DrafterUnavailableError if spec.kind == "drafter" else VerifierUnavailableError
        self.sessions: set[str] = set()  # requests whose session lives here
        self.down_until, self._wait = 0.0, timeouts.retry_s
        self.dead = False  # its actor is gone for good (no restarts left)

    @property
    def healthy(self) -> bool:
        return not self.dead and time.monotonic() >= self.down_until

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Outcome:
        """``engine.method(*args)`` in the actor; refusals raise the engine's named error."""
        if timeout_s is None:
            timeout_s = self.timeouts.drafter_s if self.kind == "drafter" else self.timeouts.verifier_s
        try:
            out: Outcome = ray.get(self.actor.call.remote(method, *args), timeout=timeout_s)
        except (RayActorError, ActorUnavailableError, GetTimeoutError) as e:
            self.dead = self.dead or isinstance(e, ActorDiedError)
            self._failed("UNAVAILABLE")
            raise self.unavailable(f"{self.kind} replica {self.name}: {type(e).__name__}") from None
        self.metrics.busy(self.kind, self.name, out.busy_s)
        if out.error is not None:
            self._failed(out.error.code, isinstance(out.error, UnavailableError))
            raise out.error
        self._wait = self.timeouts.retry_s
        return out

    def _failed(self, code: str, down: bool = True) -> None:
        self.metrics.error(self.kind, code)
        if down:
            self.down_until = time.monotonic() + self._wait
            self._wait = min(2 * self._wait, self.timeouts.retry_max_s)


class ReplicaPool:
    def __init__(self, replicas: Sequence[Replica]) -> None:
        if not replicas:
            raise ValueError("a pool needs at least one replica")
        self.replicas = list(replicas)
        self.lock = threading.Lock()

    def pick(self) -> Replica:
        """The healthy replica holding the fewest sessions; if none is healthy, the one back soonest."""
        healthy = [r for r in self.replicas if r.healthy]
        if healthy:
            return min(healthy, key=lambda r: len(r.sessions))
        return min(self.replicas, key=lambda r: (r.dead, r.down_until))


@dataclass
class Route:
    """Where one request's sessions live, and its engine time since the last chunk."""

    request_id: str
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

    def __init__(self, pool: ReplicaPool, route: Route, metrics: Metrics) -> None:
        self.pool, self.route, self.metrics = pool, route, metrics

    def _home(self) -> Replica:
        with self.pool.lock:
            current: Replica | None = getattr(self.route, self.kind)
            if current is not None and current.healthy:
                return current
            new = self.pool.pick()
            if new is not current:
                if current is not None:
                    current.sessions.discard(self.route.request_id)
                    self.metrics.fallback(f"{self.kind}_rehome")
                new.sessions.add(self.route.request_id)
                setattr(self.route, self.kind, new)
                self.route.held.add(new)
                self._gauge()
            return new

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
                replica.sessions.discard(self.route.request_id)
            self._gauge()

    def _gauge(self) -> None:
        for r in self.pool.replicas:
            self.metrics.sessions(self.kind, r.name, len(r.sessions))


class RoutedDrafter(_Routed, Drafter):
    kind = "drafter"

    def _call(self, method: str, *args: Any) -> Any:
        replica = self._home()
        timeout_s = replica.timeouts.prefill_s if method == "prefill" else None
        out = replica.call(method, *args, timeout_s=timeout_s)
        self.route.drafter_s += out.busy_s
        return out.value

    def info(self) -> DrafterInfo:
        return self._call("info")

    def prefill(self, session_id: str, delta: FeatureDelta) -> int:
        return self._call("prefill", session_id, delta)

    def draft(self, session_id: str, anchor: int, base: int, params: TreeParams) -> DraftResult:
        return self._call("draft", session_id, anchor, base, params)

    def commit(self, session_id: str, delta: FeatureDelta) -> int:
        return self._call("commit", session_id, delta)


class RoutedVerifier(_Routed, Verifier):
    kind = "verifier"

    def __init__(self, pool: ReplicaPool, route: Route, metrics: Metrics,
                 batchers: dict[Replica, VerifyBatcher]) -> None:
        super().__init__(pool, route, metrics)
        self.batchers = batchers
        self._prefills = 0

    def info(self) -> VerifierInfo:
        return self._home().call("info").value

    def prefill(self, session_id: str, token_ids: list[int], sampling: SamplingParams = SamplingParams(),
                anchor: int | None = None) -> PrefillResult:
        replica = self._home()
        if self._prefills:
            self.metrics.fallback("verifier_reprefill")
        self._prefills += 1
        out = replica.call("prefill", session_id, token_ids, sampling, anchor,
                           timeout_s=replica.timeouts.prefill_s)
        self.route.verifier_s += out.busy_s
        return out.value

    def verify(
        self, session_id: str, base: int, tree: TokenTree, want_node_probs: bool = False
    ) -> VerifyResult:
        answer = self.batchers[self._home()].submit(VerifyCall(session_id, base, tree, want_node_probs))
        res, busy_s, queue_s = answer.result()
        self.route.verifier_s += busy_s
        self.route.queue_s += queue_s
        if isinstance(res, BaseException):
            raise res
        return res

    def calibrate_cost(self):
        """TAPS's cost model: the replica's own (an in-process verifier measures its forwards)."""
        return self._home().call("calibrate_cost", timeout_s=self.pool.replicas[0].timeouts.prefill_s).value


class VerifyBatcher:
    """Continuous batching for one verifier replica, on its own thread."""

    def __init__(self, replica: Replica, max_batch: int,
                 on_batch: Callable[[Replica, int, float], None]) -> None:
        self.replica, self.max_batch, self.on_batch = replica, max_batch, on_batch
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"batcher-{replica.name}")
        self._thread.start()

    def submit(self, call: VerifyCall) -> Future:
        """A future of ``(VerifyResult | EngineError, batch engine seconds, queued seconds)``."""
        fut: Future = Future()
        self._queue.put((call, fut, time.monotonic()))
        return fut

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while batch[-1] is not None and len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stopping = batch[-1] is None
            batch = [b for b in batch if b is not None]
            if batch:
                self._send(batch)
            if stopping:
                return

    def _send(self, batch: list[tuple[VerifyCall, Future, float]]) -> None:
        start = time.monotonic()
        try:
            out = self.replica.call("verify_batch", [c for c, _, _ in batch])
        except EngineError as e:  # the whole call failed (replica away): every request sees it
            for _, fut, _ in batch:
                fut.set_exception(_copy(e))
            return
        except BaseException as e:  # noqa: BLE001 - a bug: fail the requests, keep the batcher
            for _, fut, _ in batch:
                fut.set_exception(e)
            return
        self.on_batch(self.replica, len(batch), out.busy_s)
        for (_, fut, queued), res in zip(batch, out.value):
            if isinstance(res, EngineError):
                self.replica.metrics.error("verifier", res.code)
            fut.set_result((res, out.busy_s, start - queued))


def _copy(e: EngineError) -> EngineError:
    """One exception object per waiting thread (a shared one would mix their tracebacks)."""
    try:
        return type(e)(*e.args)
    except TypeError:
        return e
