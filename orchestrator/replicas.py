"""The driver's handles on the engines (docs/design.md §3).

A ``Replica`` calls one engine (an actor, or a remote engine's client directly) with a
deadline, re-raises the engine's named errors, and backs off after a failure (unreachable,
dead, too slow); a ``ReplicaPool`` picks the healthy replica holding the fewest sessions.
A replica that went down may come back another process (an actor restarted, a pod
replaced): where its pool set ``check``, it is asked again before it serves. One that now
computes otherwise (``mismatch``, by name) gets sessions only while no replica that
computes alike is healthy: a session re-homed there would not continue bitwise, and a
rolling upgrade must not leave the old orchestrator with no replica at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from orchestrator.actors import ActorEngine, DirectEngine, Outcome, ReplicaSpec
from orchestrator.metrics import Metrics
from presto_sd.engine.calls import EngineCall
from presto_sd.engine.messages import (
    DrafterUnavailableError,
    EngineError,
    SessionNotFoundError,
    UnavailableError,
    VerifierUnavailableError,
)

log = logging.getLogger("orchestrator")


@dataclass(frozen=True)
class Timeouts:
    drafter_s: float = 30.0  # past this a round goes on without a tree
    verifier_s: float = 120.0  # a verify batch, with the queue in front of it
    prefill_s: float = 300.0
    retry_s: float = 0.5  # a failed replica is skipped this long, doubling up to retry_max_s
    retry_max_s: float = 8.0


class Replica:
    def __init__(self, spec: ReplicaSpec, engine: ActorEngine | DirectEngine, timeouts: Timeouts,
                 metrics: Metrics) -> None:
        self.kind, self.name, self.engine = spec.kind, spec.name, engine
        self.timeouts, self.metrics = timeouts, metrics
        self.unavailable = DrafterUnavailableError if spec.kind == "drafter" else VerifierUnavailableError
        self.sessions: set[str] = set()  # requests whose session lives here
        self.down_until, self._wait = 0.0, timeouts.retry_s
        self.dead = False  # its actor is gone for good (no restarts left)
        self.max_context: int | None = None  # a verifier's context window, once asked
        # set by a pool whose sessions need its replicas alike: why this one differs, or None
        self.check: Callable[[Replica, float], str | None] | None = None
        self.recheck = False  # it went down or forgot a session: ask ``check`` before it serves again
        self.mismatch: str | None = None  # how it differs, as ``check`` last said (None: alike)

    @property
    def actor(self) -> Any:
        """The Ray actor of an in-process engine (None: a remote engine, called directly)."""
        return self.engine.actor

    def round_trip_s(self) -> float:
        """A call's cost beyond the engine's work: the network to a remote engine, the actor
        hop to an in-process one (median of the last calls: ``engine.link``)."""
        return self.engine.link.value

    @property
    def healthy(self) -> bool:
        return not self.dead and time.monotonic() >= self.down_until

    def call(self, call: EngineCall, timeout_s: float | None = None) -> Outcome:
        """``call`` on the engine (in its actor); refusals raise the engine's named error."""
        if timeout_s is None:
            timeout_s = self.timeouts.drafter_s if self.kind == "drafter" else self.timeouts.verifier_s
        try:
            if self.recheck:
                self._recheck(timeout_s)
            out: Outcome = self.engine.call(call, timeout_s=timeout_s)
        except (RayActorError, ActorUnavailableError, GetTimeoutError) as e:
            self.dead = self.dead or isinstance(e, ActorDiedError)
            self.failed("UNAVAILABLE")
            raise self.unavailable(f"{self.kind} replica {self.name}: {type(e).__name__}") from None
        self.metrics.busy(self.kind, self.name, out.busy_s)
        self.metrics.link(self.kind, self.name, self.engine.link.value)
        if out.error is not None:
            self.failed(out.error.code, isinstance(out.error, UnavailableError))
            if isinstance(out.error, SessionNotFoundError):
                self.forgot_session()
            raise out.error
        self._wait = self.timeouts.retry_s
        return out

    def failed(self, code: str, down: bool = True) -> None:
        """Count a failure; ``down``: skip the replica a while (backing off), so the next
        call re-homes its session, and (where the pool checks) ask it again when it is back."""
        self.metrics.error(self.kind, code)
        if down:
            self.down_until = time.monotonic() + self._wait
            self._wait = min(2 * self._wait, self.timeouts.retry_max_s)
            self.recheck = self.check is not None

    def forgot_session(self) -> None:
        """It answered that a session it held is unknown: it may have restarted, so ask again."""
        self.recheck = self.check is not None

    def _recheck(self, timeout_s: float) -> None:
        """Back from a failure: ``check`` it before its first call. Found to differ, the call
        is refused (UNAVAILABLE, so its session re-homes where it is computed alike, if any)."""
        self.recheck = False
        try:
            mismatch = self.check(self, timeout_s)
        except EngineError as e:  # not answering yet: still down, asked again when back
            self.failed(e.code)
            raise self.unavailable(f"{self.kind} replica {self.name}: {e}") from None
        changed, self.mismatch = mismatch != self.mismatch, mismatch
        if changed and mismatch is not None:
            self.metrics.error(self.kind, "MISMATCH")
            log.warning("%s replica %s came back computing otherwise: %s", self.kind, self.name, mismatch)
            raise self.unavailable(f"{self.kind} replica {self.name} came back computing otherwise "
                                   f"(its sessions go where replicas compute alike): {mismatch}")


class ReplicaPool:
    def __init__(self, replicas: Sequence[Replica]) -> None:
        if not replicas:
            raise ValueError("a pool needs at least one replica")
        self.replicas = list(replicas)
        self.lock = threading.Lock()

    def pick(self) -> Replica:
        """The healthy replica holding the fewest sessions, among those that compute alike
        first (``Replica.mismatch``); if none is healthy, the one back soonest."""
        healthy = [r for r in self.replicas if r.healthy]
        if healthy:
            alike = [r for r in healthy if r.mismatch is None]
            return min(alike or healthy, key=lambda r: len(r.sessions))
        return min(self.replicas, key=lambda r: (r.dead, r.down_until))
