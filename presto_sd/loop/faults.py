"""What the generation loop does when an engine fails (docs/design.md §3, Faults).

- The drafter only proposes, so it gets each round's feature delta only when it is asked
  to draft next, in the same call (the deltas of the rounds between travel as one), and it may fail:
  while it is down, timing out, full, or restarted without our session,
  ``DrafterLink.draft`` returns None and the round is a plain AR ``step`` on the verifier
  (still lossless). The link keeps every feature delta of the
  request; when the drafter answers again it is caught up (the deltas it missed, or a
  fresh prefill from all of them) and speculation resumes.
- The verifier holds the session's KV cache. When it loses the session (a restart:
  NOT_FOUND) or is unreachable, ``VerifierLink`` re-prefills it from the committed tokens
  it holds, the pending anchor given (not redrawn), and retries the round, waiting for
  the verifier up to ``verifier_wait_s``. No committed token is lost or repeated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from presto_sd.engine.drafter import Drafter, DraftResult
from presto_sd.engine.messages import (
    DrafterUnavailableError,
    FeatureDelta,
    LimitExceededError,
    SessionNotFoundError,
    StaleBaseError,
    VerifierUnavailableError,
)
from presto_sd.engine.verifier import PrefillResult, Verifier, VerifyResult
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.builders import TreeParams
from presto_sd.method.tree import TokenTree

# down, too slow, or full (its session cap or context limit): go on without it for now
_DRAFTER_AWAY = (DrafterUnavailableError, LimitExceededError)


@dataclass(frozen=True)
class FaultPolicy:
    drafter_retry_s: float = 0.5  # first wait before asking a failed drafter again
    drafter_retry_max_s: float = 8.0  # the wait doubles up to this
    verifier_wait_s: float = 60.0  # how long the verifier may stay away before giving up
    verifier_retry_s: float = 0.25  # between attempts to reach it


class DrafterLink:
    """The loop's side of a drafter session: in sync, behind by some deltas, or lost."""

    def __init__(
        self, drafter: Drafter, session_id: str, policy: FaultPolicy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.drafter, self.sid, self.policy, self.clock = drafter, session_id, policy, clock
        self.log: list[FeatureDelta] = []  # every delta of the request: the drafter's context
        self.synced = 0  # how many of them the drafter has
        self.lost = True  # no session there: catching up means a prefill
        self.opened = False
        self.tried = False  # a prefill was sent: later ones restart it (it may have been applied)
        self.retry_at, self.wait = 0.0, policy.drafter_retry_s

    def prefill(self, delta: FeatureDelta) -> None:
        """Log the prompt's features; the drafter session opens with the first draft, from
        the whole log (``_reopen``). A request that never drafts (``ar`` rounds, TAPS's gate
        shut under load) costs the drafter nothing, and the first token never waits for it."""
        self.log = [delta]

    def commit(self, delta: FeatureDelta) -> None:
        """Log the round's delta; the drafter gets it with the next draft, in the same call
        (``Drafter.commit_and_draft``: one round trip to a remote drafter): a round that does
        not draft (an AR step, TAPS's gate shut) costs the drafter nothing, and the deltas of
        several such rounds travel as one."""
        self.log.append(delta)

    def draft(self, anchor: int, base: int, params: TreeParams) -> DraftResult | None:
        """A tree, or None when the drafter cannot give one this round."""
        if self.lost or self.synced < len(self.log):
            if self.clock() < self.retry_at:
                return None
            if self.lost and not self._reopen():
                return None
        pending = _concat(self.log[self.synced:]) if self.synced < len(self.log) else None
        try:
            if pending is None:
                result = self.drafter.draft(self.sid, anchor, base, params)
            else:
                result = self.drafter.commit_and_draft(self.sid, pending, anchor, base, params)
        except (SessionNotFoundError, StaleBaseError):  # restarted, or applied a call we saw fail
            self.lost, self.synced = True, 0
            return None
        except _DRAFTER_AWAY:
            self._back_off()
            return None
        self.synced, self.wait = len(self.log), self.policy.drafter_retry_s
        return result

    def close(self) -> None:
        if self.opened:
            _close_quietly(self.drafter, self.sid)

    def _reopen(self) -> bool:
        """A drafter session from the whole log (the prompt's features and every round's);
        False while the drafter is away."""
        restart, self.tried = self.tried, True  # a prefill sent before may have been applied
        try:
            self.drafter.prefill(self.sid, _concat(self.log), restart=restart)
        except _DRAFTER_AWAY:
            self._back_off()
            return False
        self.lost, self.opened, self.synced = False, True, len(self.log)
        self.wait = self.policy.drafter_retry_s
        return True

    def _back_off(self) -> None:
        self.retry_at = self.clock() + self.wait
        self.wait = min(2 * self.wait, self.policy.drafter_retry_max_s)


class VerifierLink:
    """The loop's side of a verifier session: the committed tokens, to re-prefill from."""

    def __init__(
        self, verifier: Verifier, session_id: str, sampling: SamplingParams, policy: FaultPolicy
    ) -> None:
        self.verifier, self.sid, self.sampling, self.policy = verifier, session_id, sampling, policy
        self.tokens: list[int] = []  # prompt + committed output; the last is the pending anchor
        self.tried = False  # a prefill was sent: later ones restart it (it may have been applied)

    def prefill(self, prompt_ids: list[int], resume: Sequence[int] = ()) -> PrefillResult:
        """The session on the prompt; with ``resume`` (output already sent) on it too, its
        last token the pending anchor."""
        if resume:
            self.tokens = [*prompt_ids, *resume]
            sampling = self._resumed_sampling()

            def attempt_resumed() -> PrefillResult:
                restart, self.tried = self.tried, True
                return self.verifier.prefill(self.sid, self.tokens[:-1], sampling, anchor=self.tokens[-1],
                                             restart=restart)

            return self._retry(attempt_resumed)

        def attempt() -> PrefillResult:
            restart, self.tried = self.tried, True
            return self.verifier.prefill(self.sid, list(prompt_ids), self.sampling, restart=restart)

        pre = self._retry(attempt)
        self.tokens = [*prompt_ids, pre.anchor]
        return pre

    def max_context(self) -> int:
        """The verifier's context window (prompt + output), asked once the session is open."""
        return self._retry(self.verifier.max_context)

    def verify(self, base: int, tree: TokenTree | None) -> VerifyResult:
        """Verify ``tree`` (None: one AR step), re-prefilling a lost session first."""
        def attempt() -> VerifyResult:
            if tree is None:
                return self.verifier.step(self.sid, base, self.tokens[-1])
            return self.verifier.verify(self.sid, base, tree)

        def recover() -> None:
            self.verifier.prefill(self.sid, self.tokens[:-1], self._resumed_sampling(),
                                  anchor=self.tokens[-1], restart=True)

        res = self._retry(attempt, recover)
        self.tokens.extend(res.new_tokens)
        return res

    def close(self) -> None:
        _close_quietly(self.verifier, self.sid)

    def _resumed_sampling(self) -> SamplingParams:
        """A fresh seed per resume point: replaying the first draws would correlate tokens."""
        seed = self.sampling.seed
        if seed is None:
            return self.sampling
        return replace(self.sampling, seed=(seed * 1_000_003 + len(self.tokens)) % 2**63)

    def _retry(self, attempt: Callable, recover: Callable | None = None):
        """``attempt()`` until it answers; after a failure, ``recover()`` (re-prefill) first."""
        give_up = time.monotonic() + self.policy.verifier_wait_s
        failed = False
        while True:
            try:
                if failed and recover is not None:
                    recover()
                return attempt()
            except (SessionNotFoundError, VerifierUnavailableError) as e:
                if recover is None and isinstance(e, SessionNotFoundError):
                    raise
                if time.monotonic() > give_up:  # the request's retry budget is spent
                    raise VerifierUnavailableError(
                        f"no verifier answered within the retry budget ({self.policy.verifier_wait_s:g} s, "
                        f"FaultPolicy.verifier_wait_s): {e}") from e
                failed = True
                if isinstance(e, VerifierUnavailableError):
                    time.sleep(self.policy.verifier_retry_s)


def _concat(deltas: list[FeatureDelta]) -> FeatureDelta:
    """Contiguous deltas as one (a drafter prefill from the request's whole context)."""
    if len(deltas) == 1:
        return deltas[0]
    tokens = tuple(t for d in deltas for t in d.tokens)
    return FeatureDelta(deltas[0].start, tokens, torch.cat([d.features for d in deltas]))


def _close_quietly(engine: Drafter | Verifier, sid: str) -> None:
    try:
        engine.close(sid)
    except Exception:  # noqa: BLE001 - closing is best effort; the session may be gone
        pass
