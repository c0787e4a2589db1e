"""The step engine: one ``step()`` runs a round for every sequence the scheduler picks.

    plan = scheduler.schedule()                     # decodes, prompts (scheduler.py)
    drafter.draft_batch(the decodes that draft)     # one call: each carries its pending deltas
    verifier.verify_batch(prompts + trees + AR)     # one call: one target forward
    post-process: accept, stream out, finish, free  # per sequence

Every way of running presto-sd goes through it: embedded generation is a batch of one
(``stream_generate``), a server steps many. Engine calls are batched and their refusals
come back per item, so one request's error never fails another's; engine faults follow
the rules of ``sequence.py`` (a drafter away means AR steps, a verifier lost means a
re-prefill). A sequence's output is exactly the one it gets alone: greedy, the target's
AR output (the engines are row-invariant: docs/design.md, "Bitwise, not just argmax-equal").
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

from presto_sd.engine.calls import Prefill
from presto_sd.engine.drafter import DraftCall, Drafter, DraftResult
from presto_sd.engine.messages import AlreadyExistsError, EngineError, LimitExceededError, copy_error
from presto_sd.engine.verifier import (
    PrefillCall,
    PrefillResult,
    Verifier,
    VerifyCall,
    VerifyResult,
    call_rows,
)
from presto_sd.loop.faults import DRAFTER_AWAY
from presto_sd.loop.scheduler import Scheduler, SchedulerConfig, StepPlan
from presto_sd.loop.sequence import GenerationParams, RoundStats, Sequence, Status, TokenChunk
from presto_sd.loop.taps_feedback import TapsFeedback
from presto_sd.method.batch_cost import BatchCostCurve, SharedForward
from presto_sd.method.builders import RoundContext
from presto_sd.method.tree import TokenTree


@dataclass
class _Round:
    """One decoding sequence's share of a step."""

    seq: Sequence
    wanted: bool = False  # it meant to draft (not AR, not gated)
    gated: bool = False
    draft: DraftResult | None = None
    call: DraftCall | None = None


class StepEngine:
    def __init__(self, verifier: Verifier, drafter: Drafter | None = None,
                 config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.verifier, self.drafter, self.clock = verifier, drafter, clock
        self.scheduler = Scheduler(config or SchedulerConfig())
        self.sequences: dict[str, Sequence] = {}
        self._window: int | None = None  # the verifier's context window, asked once
        # seconds vs rows of this engine's verifier forwards, and the last one's load: what a
        # sequence's tree shares the forward with (``shared_forward``, TAPS under load)
        self.cost_curve = BatchCostCurve()
        self.last_rows, self.last_calls = 0, 0
        self._room_wait: list[Sequence] = []  # refused for KV room: they wait for a finish

    # -- requests ---------------------------------------------------------------------
    def add(self, prompt_ids: Seq[int], params: GenerationParams,
            detokenize: Callable[[list[int]], str] | None = None, seq_id: str | None = None,
            resume: Seq[int] = ()) -> Sequence:
        """A new request; it starts at the next step. ``resume``: output a client already
        has (``stream_generate``)."""
        seq_id = seq_id or uuid.uuid4().hex
        if seq_id in self.sequences:
            raise AlreadyExistsError("a request with this id is running")
        seq = Sequence(seq_id, prompt_ids, params, detokenize, resume, has_drafter=self.drafter is not None)
        if seq.finish_reason is not None:  # the client has it all but the ending
            seq.chunks.append(TokenChunk((), None, seq.finish_reason))
            seq.status = Status.FINISHED
            return seq
        self.sequences[seq_id] = seq
        self.scheduler.add(seq)
        return seq

    def cancel(self, seq_id: str) -> None:
        """Stop a request between steps; its sessions are closed, the others go on."""
        seq = self.sequences.get(seq_id)
        if seq is not None:
            self._finish(seq)

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    def idle_s(self) -> float:
        """Seconds until a sequence can go on, when a step found none that could (each one
        waiting out an engine's retry pause); 0 when one can now."""
        now = self.clock()
        due = [max(s.verifier.retry_at, now) for s in self.sequences.values() if s not in self._room_wait]
        return max(0.0, min(due, default=0.0) - now)

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One round for every sequence the scheduler picks; the sequences that produced
        chunks or ended (their ``chunks``, ``error``)."""
        now = self.clock()
        touched = self._settle_windows()
        for seq in list(self.scheduler.running):
            if seq.next_round is None and seq.windowed:
                self._guarded(seq, self._decide, seq, now)
                if seq.finished:  # its error goes out with this step
                    touched.append(seq)
        plan = self.scheduler.schedule(now)
        if not plan:
            return touched
        if plan.long_prefill is not None:
            self._long_prefill(plan.long_prefill, now)
            touched.append(plan.long_prefill)
        t0 = self.clock()
        rounds = self._draft(plan, now)
        t1 = self.clock()
        answers = self._verify(plan, rounds)
        t2 = self.clock()
        for seq, answer in zip(plan.prefills, answers):
            self._guarded(seq, self._prefilled, seq, answer, t2)
        for r, answer in zip(rounds, answers[len(plan.prefills):]):
            self._guarded(r.seq, self._verified, r, answer, t1 - t0 if r.call else 0.0, t2 - t1, t2)
        return list(dict.fromkeys([*touched, *plan.prefills, *plan.decodes]))  # a failed draft too

    def _decide(self, seq: Sequence, now: float) -> None:
        """The sequence's next round: a tree or an AR step, and the rows it may take. Made
        once per round, before the scheduler picks (TAPS's gate counts the rounds it is
        asked about), and kept until the round runs."""
        side, depth = seq.drafter, seq.depth_left()
        can_draft = side is not None and depth >= 1
        if can_draft and seq.method.sizes_itself and seq.taps is None:
            seq.taps = TapsFeedback(self.verifier, self.drafter, seed=seq.seq_id, load=self.shared_forward)
        r = _Round(seq)
        r.gated = can_draft and seq.taps is not None and not seq.taps.should_draft()
        r.wanted = can_draft and not r.gated
        seq.next_round = r
        seq.next_round_rows = seq.tree_params.budget + 1 if r.wanted and side.can_try(now) else 1

    def _draft(self, plan: StepPlan, now: float) -> list[_Round]:
        rounds = []
        for seq in plan.decodes:
            r, seq.next_round, seq.next_round_rows = seq.next_round, None, 1
            rounds.append(r)
            self._guarded(seq, self._plan_draft, r, now)
        rounds = [r for r in rounds if not r.seq.finished]
        drafting = [r for r in rounds if r.call is not None]
        if drafting:
            answers = _each(self.drafter.draft_batch, [r.call for r in drafting])
            for r, answer in zip(drafting, answers):
                self._guarded(r.seq, self._drafted, r, answer, now)
        return [r for r in rounds if not r.seq.finished]

    def _plan_draft(self, r: _Round, now: float) -> None:
        """The round's draft call, if it drafts and the drafter may be asked (a lost session
        is opened first, from the whole log)."""
        seq, side = r.seq, r.seq.drafter
        if not r.wanted or not side.can_try(now):
            return
        if side.lost:
            delta, restart = side.reopen()
            try:
                self.drafter.prefill(seq.seq_id, delta, restart=restart)
            except DRAFTER_AWAY:
                side.away(now)
                return
            side.reopened()
        depth = seq.depth_left()
        params = seq.tree_params if depth == seq.tree_params.depth else replace(seq.tree_params, depth=depth)
        measured = seq.taps.round_context() if seq.taps is not None else RoundContext()
        r.call = side.draft_call(seq.seq_id, seq.anchor, seq.base, seq.method.name, params, measured)

    def _drafted(self, r: _Round, answer: DraftResult | EngineError, now: float) -> None:
        r.draft = r.seq.drafter.answered(answer, now)

    def _verify(self, plan: StepPlan, rounds: list[_Round]) -> list:
        calls: list[PrefillCall | VerifyCall] = [s.verifier.prefill_call(s.seq_id) for s in plan.prefills]
        for r in rounds:
            seq = r.seq
            if r.draft is None:
                calls.append(VerifyCall(seq.seq_id, seq.base, TokenTree.root_only(seq.anchor)))
            else:  # a self-speculative draft names the mask rows its verify carries
                calls.append(VerifyCall(seq.seq_id, seq.base, r.draft.tree, chains=r.draft.chains))
        if not calls:
            return []
        t0 = self.clock()
        answers = _each(self.verifier.verify_batch, calls)
        rows = sum(call_rows(c) for c in calls)
        self.cost_curve.observe(rows, self.clock() - t0)
        self.last_rows, self.last_calls = rows, len(calls)
        return answers

    def shared_forward(self, rows: int) -> SharedForward | None:
        """The last forward without a sequence's ``rows``: the load its next tree joins (None
        when it ran alone). The other rows' tokens per step are counted as one per other
        sequence (an AR step commits one; a tree's round its tau, so this errs toward
        smaller trees)."""
        others, load = self.last_calls - 1, self.last_rows - rows
        if others < 1 or load < 1:
            return None
        if self.cost_curve.prior is None:
            self.cost_curve.prior = self.verifier.cost_model()  # shapes the sizes not seen yet
        fit = self.cost_curve.shared_fit(load)
        return None if fit is None else SharedForward(fit, float(others))

    def _long_prefill(self, seq: Sequence, now: float) -> None:
        try:
            answer = Prefill(seq.verifier.prefill_call(seq.seq_id)).run(self.verifier)
        except EngineError as e:
            answer = e
        self._guarded(seq, self._prefilled, seq, answer, self.clock())

    # -- post-processing --------------------------------------------------------------
    def _prefilled(self, seq: Sequence, answer: PrefillResult | EngineError, now: float) -> None:
        if isinstance(answer, EngineError):
            if (isinstance(answer, LimitExceededError) and seq.status is Status.WAITING
                    and self.scheduler.running):  # no room now: after one of them finishes
                self._room_wait.append(seq)
                seq.verifier.retry_at = math.inf
                return
            seq.verifier.failed(answer, now)
            return
        first = not seq.verifier.opened
        seq.verifier.prefilled(answer.anchor)
        if not first:  # a lost session restored: the round goes on next step
            return
        self.scheduler.opened(seq)
        if seq.drafter is not None:
            seq.drafter.logged(answer.delta)
        seq.anchor, seq.base = answer.anchor, answer.base
        self._settle_window(seq)

    def _settle_windows(self) -> list[Sequence]:
        """Open sequences whose first chunk waits for the verifier's context window."""
        waiting = [s for s in self.scheduler.running if not s.windowed]
        for seq in waiting:
            self._guarded(seq, self._settle_window, seq)
        return waiting

    def _settle_window(self, seq: Sequence) -> None:
        """The output's room in the window, then the first chunk (the prefill's token)."""
        if self._window is None:
            try:
                self._window = self.verifier.max_context()
            except EngineError as e:  # a fault: asked again after the pause; else the request's error
                seq.verifier.waited(e, self.clock())
                return
        seq.windowed = True
        # the verifier keeps prompt + output <= max_context; the stopper keeps the stream in it
        seq.stopper.clamp(self._window - len(seq.prompt_ids))
        first = () if seq.resumed else seq.stopper.accept((seq.anchor,))
        self._emit(seq, TokenChunk(first, None, seq.finish_reason))

    def _verified(self, r: _Round, answer: VerifyResult | EngineError, draft_s: float,
                  verify_s: float, now: float) -> None:
        seq = r.seq
        if isinstance(answer, EngineError):
            seq.verifier.failed(answer, now)  # a fault: re-prefill, then this round again
            return
        seq.verifier.committed(answer.new_tokens)
        if seq.drafter is not None:
            seq.drafter.logged(answer.delta)
        size, build_s = (r.draft.tree.size, r.draft.build_s) if r.draft is not None else (0, 0.0)
        if seq.taps is not None:
            # a self-speculative round without marginals (its first, or after a gated one) only
            # drafts the next: the gate judges the rounds that verify a draft
            drafted = r.draft is not None and r.draft.marginals.depth > 0
            tree, raw = (r.draft.tree, r.draft.node_log_acceptance) if drafted else (None, ())
            seq.taps.observe(tree, raw, seq.base, answer.accepted, draft_s, verify_s, 0.0)
        seq.anchor, seq.base = answer.bonus, answer.base
        fallback = r.wanted and r.draft is None
        stats = RoundStats(len(answer.accepted), size, draft_s, build_s, verify_s, 0.0, fallback, r.gated)
        self._emit(seq, TokenChunk(seq.stopper.accept(answer.new_tokens), stats, seq.finish_reason))

    def _emit(self, seq: Sequence, chunk: TokenChunk) -> None:
        seq.chunks.append(chunk)
        if chunk.finish_reason is not None:
            self._finish(seq)

    def _guarded(self, seq: Sequence, fn: Callable, *args) -> None:
        """``fn(*args)`` for one sequence: what it raises ends that sequence alone."""
        if seq.finished:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - the request's error, raised to its consumer
            seq.error = e
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        """Close both sessions (best effort: they may be gone) and free the sequence."""
        if seq.finished:
            return
        if seq.verifier.tried:
            _close_quietly(self.verifier, seq.seq_id)
        if seq.drafter is not None and seq.drafter.opened:
            _close_quietly(self.drafter, seq.seq_id)
        self.scheduler.finish(seq)
        self.sequences.pop(seq.seq_id, None)
        if seq in self._room_wait:
            self._room_wait.remove(seq)
        for waiting in self._room_wait:  # room freed: they may try again
            waiting.verifier.retry_at = 0.0
        self._room_wait.clear()


def _each(batch_call: Callable[[list], list], calls: list) -> list:
    """A batched engine call's answers, one per call: a whole-call refusal (the engine
    away) is every item's."""
    try:
        return batch_call(calls)
    except EngineError as e:  # one exception object per sequence: a shared one would mix tracebacks
        return [copy_error(e) for _ in calls]


def _close_quietly(engine: Drafter | Verifier, sid: str) -> None:
    try:
        engine.close(sid)
    except Exception:  # noqa: BLE001 - closing is best effort; the session may be gone
        pass
