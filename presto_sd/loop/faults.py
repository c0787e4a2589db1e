"""What a sequence does when an engine fails (docs/design.md §3, Faults).

Each sequence holds one side of each engine session (``Sequence.verifier``,
``Sequence.drafter``); the step engine asks them what to send and hands them the answers.

- The verifier holds the session's KV cache. ``VerifierSide`` keeps every committed token
  (the last is the pending anchor): when the verifier loses the session (a restart:
  NOT_FOUND) or cannot be reached, the session is re-prefilled from them with the anchor
  given, never redrawn, and the round runs again; the verifier may stay away up to
  ``verifier_wait_s`` before the request fails (UNAVAILABLE). No committed token is lost
  or repeated.
- The drafter only proposes. ``DrafterSide`` keeps every feature delta of the request; the
  drafter gets the deltas of the rounds since its last draft in the next draft call (one
  call; a round that does not draft costs the drafter nothing), and the session opens
  with the first draft, so the first token never waits for the drafter. While the drafter
  is down, timing out, full, or restarted without our session, the sequence takes plain
  AR steps (still lossless), asking again after a pause that doubles up to
  ``drafter_retry_max_s``; when it answers it is caught up (the deltas it missed, or a
  fresh prefill from all of them) and speculation resumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from presto_sd.engine.drafter import DraftCall, DraftResult
from presto_sd.engine.messages import (
    DrafterUnavailableError,
    EngineError,
    FeatureDelta,
    LimitExceededError,
    SessionNotFoundError,
    StaleBaseError,
    VerifierUnavailableError,
)
from presto_sd.engine.verifier import PrefillCall
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.builders import RoundContext, TreeParams

# down, too slow, or full (its session cap or context limit): go on without it for now
DRAFTER_AWAY = (DrafterUnavailableError, LimitExceededError)
# the verifier lost the session or cannot be reached: re-prefill it, within the wait budget
VERIFIER_AWAY = (SessionNotFoundError, VerifierUnavailableError)


@dataclass(frozen=True)
class FaultPolicy:
    drafter_retry_s: float = 0.5  # first wait before asking a failed drafter again
    drafter_retry_max_s: float = 8.0  # the wait doubles up to this
    verifier_wait_s: float = 60.0  # how long the verifier may stay away before giving up
    verifier_retry_s: float = 0.25  # between attempts to reach it


class VerifierSide:
    """The scheduler's side of a verifier session: the committed tokens, to re-prefill from."""

    def __init__(self, prompt_ids: Sequence[int], resume: Sequence[int], sampling: SamplingParams,
                 policy: FaultPolicy) -> None:
        self.prompt, self.resume = tuple(prompt_ids), tuple(resume)
        self.sampling, self.policy = sampling, policy
        self.tokens: list[int] = []  # prompt + committed output; the last is the pending anchor
        self.opened = False  # a prefill answered: the session exists (or existed) there
        self.lost = False  # it must be re-prefilled before the next round
        self.tried = False  # a prefill was sent: later ones restart it (it may have been applied)
        self.retry_at = 0.0  # after a failure: not before this time
        self.give_up_at: float | None = None  # the wait budget of the failure streak in progress

    def ready(self, now: float) -> bool:
        return now >= self.retry_at

    def prefill_call(self, session_id: str) -> PrefillCall:
        """The session's prefill: the prompt (and a resumed output, its last token the anchor),
        or after a loss, every committed token with the pending anchor given. The output
        before the anchor goes as ``decoded``: the verifier computes it as the AR steps did,
        so the stream goes on exactly as the unbroken one."""
        restart, self.tried = self.tried, True
        if self.opened or self.resume:
            tokens = self.tokens if self.opened else [*self.prompt, *self.resume]
            return PrefillCall(session_id, tuple(tokens[:-1]), self._resumed_sampling(len(tokens)),
                               anchor=tokens[-1], restart=restart or self.opened,
                               decoded=len(tokens) - 1 - len(self.prompt))
        return PrefillCall(session_id, self.prompt, self.sampling, restart=restart)

    @property
    def prompt_tokens(self) -> int:
        """Tokens its next prefill sends."""
        if self.opened:
            return len(self.tokens) - 1
        return len(self.prompt) + max(0, len(self.resume) - 1)

    def prefilled(self, anchor: int) -> None:
        if not self.opened:
            self.tokens = [*self.prompt, *self.resume] if self.resume else [*self.prompt, anchor]
        self.opened, self.lost, self.give_up_at = True, False, None

    def committed(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        self.give_up_at = None

    def failed(self, error: EngineError, now: float) -> None:
        """A call on the session failed: re-prefill it (after a pause if unreachable), or
        raise when the error is not a fault or the wait budget is spent."""
        if not self.opened and isinstance(error, SessionNotFoundError):
            raise error  # its own prefill cannot lose a session
        self.waited(error, now)
        self.lost = self.opened

    def waited(self, error: EngineError, now: float) -> None:
        """The verifier did not answer: a pause before the next try, within the wait budget
        (then the error is raised); any error other than a fault is raised at once."""
        if not isinstance(error, VERIFIER_AWAY):
            raise error
        if self.give_up_at is None:
            self.give_up_at = now + self.policy.verifier_wait_s
        elif now > self.give_up_at:  # the request's retry budget is spent
            raise VerifierUnavailableError(
                f"no verifier answered within the retry budget ({self.policy.verifier_wait_s:g} s, "
                f"FaultPolicy.verifier_wait_s): {error}") from error
        if isinstance(error, VerifierUnavailableError):
            self.retry_at = now + self.policy.verifier_retry_s

    def _resumed_sampling(self, n_tokens: int) -> SamplingParams:
        """A fresh seed per resume point: replaying the first draws would correlate tokens."""
        seed = self.sampling.seed
        if seed is None:
            return self.sampling
        return replace(self.sampling, seed=(seed * 1_000_003 + n_tokens) % 2**63)


class DrafterSide:
    """The scheduler's side of a drafter session: in sync, behind by some deltas, or lost."""

    def __init__(self, policy: FaultPolicy) -> None:
        self.policy = policy
        self.log: list[FeatureDelta] = []  # every delta of the request: the drafter's context
        self.synced = 0  # how many of them the drafter has
        self.lost = True  # no session there: catching up means a prefill (from the whole log)
        self.opened = False
        self.tried = False  # a prefill was sent: later ones restart it (it may have been applied)
        self.retry_at, self.wait = 0.0, policy.drafter_retry_s
        self._sending = 0  # len(log) when the draft call in flight was made

    def logged(self, delta: FeatureDelta) -> None:
        """A verified round's features (the prompt's first): they go with the next draft."""
        self.log.append(delta)

    def can_try(self, now: float) -> bool:
        """False while backing off from a failure and not in sync."""
        return not ((self.lost or self.synced < len(self.log)) and now < self.retry_at)

    def reopen(self) -> tuple[FeatureDelta, bool]:
        """The prefill that opens a lost session: the whole log, and whether to restart."""
        restart, self.tried = self.tried, True
        return concat(self.log), restart

    def reopened(self) -> None:
        self.lost, self.opened, self.synced = False, True, len(self.log)
        self.wait = self.policy.drafter_retry_s

    def draft_call(self, session_id: str, anchor: int, base: int, method: str, params: TreeParams,
                   context: RoundContext) -> DraftCall:
        pending = concat(self.log[self.synced:]) if self.synced < len(self.log) else None
        self._sending = len(self.log)
        return DraftCall(session_id, anchor, base, method, params, commit=pending, context=context)

    def answered(self, answer: DraftResult | EngineError, now: float) -> DraftResult | None:
        """The draft's tree, or None when the drafter could not give one (then an AR step)."""
        if isinstance(answer, (SessionNotFoundError, StaleBaseError)):
            self.lost, self.synced = True, 0  # restarted, or it applied a call we saw fail
            return None
        if isinstance(answer, DRAFTER_AWAY):
            self.away(now)
            return None
        if isinstance(answer, EngineError):
            raise answer
        self.synced, self.wait = self._sending, self.policy.drafter_retry_s
        return answer

    def away(self, now: float) -> None:
        self.retry_at = now + self.wait
        self.wait = min(2 * self.wait, self.policy.drafter_retry_max_s)


def concat(deltas: list[FeatureDelta]) -> FeatureDelta:
    """Contiguous deltas as one (a drafter prefill from the request's whole context)."""
    if len(deltas) == 1:
        return deltas[0]
    tokens = tuple(t for d in deltas for t in d.tokens)
    # a drafted next block is the last round's: it follows that round's bonus
    features = torch.cat([d.features for d in deltas])
    return FeatureDelta(deltas[0].start, tokens, features, deltas[-1].next_block)
