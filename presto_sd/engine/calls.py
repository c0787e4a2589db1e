"""Engine calls as values: what the Ray actors, the replica pools and the gRPC servicers pass.

Each call is one engine operation with its arguments, and ``run(engine)`` is the one line
that says which method of the ``Verifier`` / ``Drafter`` interface it is: a call that
crosses a process (a Ray actor) or waits its turn (a server's engine thread) is the call
that runs, never a method name looked up at run time. The per-item calls of a batch
(``PrefillCall``, ``VerifyCall``, ``DraftCall``) are the contracts' own.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from presto_sd.engine.drafter import DraftCall, Drafter, DraftResult
from presto_sd.engine.messages import EngineError, FeatureDelta
from presto_sd.engine.verifier import (
    BatchAnswer,
    BatchCall,
    PrefillCall,
    PrefillResult,
    Verifier,
    VerifyCall,
    VerifyResult,
)

Engine = Verifier | Drafter


# -- either engine ------------------------------------------------------------------------
@dataclass(frozen=True)
class Info:
    def run(self, engine: Engine) -> Any:
        return engine.info()


@dataclass(frozen=True)
class Close:
    session_id: str

    def run(self, engine: Engine) -> None:
        return engine.close(self.session_id)


@dataclass(frozen=True)
class CloseIdle:
    """A server's reaper: close the sessions idle longer than ``ttl_s``; their ids."""

    ttl_s: float

    def run(self, engine: Any) -> list[str]:
        return engine.close_idle(self.ttl_s)


@dataclass(frozen=True)
class Apply:
    """Any picklable function of the engine (a probe in a test, an operator's one-off)."""

    fn: Callable[[Any], Any]

    def run(self, engine: Any) -> Any:
        return self.fn(engine)


# -- the verifier -------------------------------------------------------------------------
@dataclass(frozen=True)
class MaxContext:
    def run(self, engine: Verifier) -> int:
        return engine.max_context()


@dataclass(frozen=True)
class CalibrateCost:
    def run(self, engine: Verifier) -> Any:
        return engine.calibrate_cost()


@dataclass(frozen=True)
class Prefill:
    """A prompt alone (a long one: the engine prefills it in chunks)."""

    call: PrefillCall

    def run(self, engine: Verifier) -> PrefillResult:
        c = self.call
        return engine.prefill(c.session_id, list(c.token_ids), c.sampling, c.anchor, c.restart, c.decoded)

    def steps(self, engine: Any) -> Generator[None, None, PrefillResult]:
        """The same prefill one chunk a step, on an engine that can yield between chunks."""
        c = self.call
        return engine.prefill_steps(c.session_id, list(c.token_ids), c.sampling, c.anchor, c.restart,
                                    c.decoded)


@dataclass(frozen=True)
class Verify:
    call: VerifyCall

    def run(self, engine: Verifier) -> VerifyResult:
        c = self.call
        return engine.verify(c.session_id, c.base, c.tree, c.want_node_probs)


@dataclass(frozen=True)
class Step:
    session_id: str
    base: int
    anchor: int

    def run(self, engine: Verifier) -> VerifyResult:
        return engine.step(self.session_id, self.base, self.anchor)


@dataclass(frozen=True)
class VerifyBatch:
    calls: tuple[BatchCall, ...]

    def run(self, engine: Verifier) -> list[BatchAnswer]:
        return engine.verify_batch(self.calls)


# -- the drafter --------------------------------------------------------------------------
@dataclass(frozen=True)
class DrafterPrefill:
    session_id: str
    delta: FeatureDelta
    restart: bool = False

    def run(self, engine: Drafter) -> int:
        return engine.prefill(self.session_id, self.delta, self.restart)


@dataclass(frozen=True)
class Commit:
    session_id: str
    delta: FeatureDelta

    def run(self, engine: Drafter) -> int:
        return engine.commit(self.session_id, self.delta)


@dataclass(frozen=True)
class Draft:
    """One draft, after its commit when the call carries one (``commit_and_draft``)."""

    call: DraftCall

    def run(self, engine: Drafter) -> DraftResult:
        c = self.call
        if c.commit is None:
            return engine.draft(c.session_id, c.anchor, c.base, c.method, c.params, c.context)
        return engine.commit_and_draft(c.session_id, c.commit, c.anchor, c.base, c.method, c.params,
                                       c.context)


@dataclass(frozen=True)
class DraftBatch:
    calls: tuple[DraftCall, ...]

    def run(self, engine: Drafter) -> list[DraftResult | EngineError]:
        return engine.draft_batch(self.calls)


EngineCall = (Info | Close | CloseIdle | Apply | MaxContext | CalibrateCost | Prefill | Verify | Step
              | VerifyBatch | DrafterPrefill | Commit | Draft | DraftBatch)
BATCHED = (VerifyBatch, DraftBatch)  # answers per item: their refusals travel inside the list
