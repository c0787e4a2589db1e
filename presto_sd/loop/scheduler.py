"""The scheduler: it owns every live sequence and decides each step's batch.

Per step (``StepEngine.step``) it picks, within the step's bounds:

- **decodes**: running sequences, each one round (a tree, or one AR token: the step
  engine decides which before the schedule, so an AR step is counted as the one row it
  is). All of them when they fit; otherwise in rotation, so every sequence gets its turn.
- **prefills**: waiting sequences in arrival order (first prompts, and re-prefills of
  sessions a verifier lost), while their prompt tokens fit ``max_prefill_tokens``. They
  ride in the same verifier forward as the decodes. A prompt longer than that bound is
  prefilled by its own call, in the engine's chunks, before the step's forward: one a
  step (``StepPlan.long_prefill``); the decodes of that step wait for it.

The bounds are rows of the one verifier forward (``max_step_tokens``: tree nodes, AR
tokens and prompt tokens) and sequences per step (``max_seqs``). The KV budget is the
verifier's: a prompt it refuses for room (RESOURCE_EXHAUSTED) while others run waits for
one of them to finish instead of failing. No waiting prompt starves: the oldest one is
taken whenever a sequence slot is free, ahead of any younger one, and the decodes leave
its rows free in the forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from presto_sd.engine.verifier import MAX_FORWARD_ROWS
from presto_sd.loop.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_seqs: int = 64  # sequences running at once (each holds a verifier and a drafter session)
    max_step_tokens: int = 1024  # rows of one verifier forward: tree nodes + AR tokens + prompts
    max_prefill_tokens: int = 512  # prompt tokens a step adds beside the decodes

    def __post_init__(self) -> None:
        if self.max_seqs < 1 or self.max_step_tokens < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_seqs, max_step_tokens and max_prefill_tokens must be >= 1")
        if self.max_step_tokens > MAX_FORWARD_ROWS:  # past it a verifier refuses the batch's tail
            raise ValueError(f"max_step_tokens {self.max_step_tokens}: at most {MAX_FORWARD_ROWS}, the "
                             "rows a verifier forward's kernels are probed row-invariant for")


@dataclass
class StepPlan:
    decodes: list[Sequence] = field(default_factory=list)  # one round each
    prefills: list[Sequence] = field(default_factory=list)  # in the verifier forward of the decodes
    long_prefill: Sequence | None = None  # a prompt over max_prefill_tokens, prefilled alone

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills or self.long_prefill)


class Scheduler:
    def __init__(self, config: SchedulerConfig = SchedulerConfig()) -> None:
        self.config = config
        self.waiting: deque[Sequence] = deque()  # no open verifier session, in arrival order
        self.running: list[Sequence] = []
        self._turn = 0  # where the next rotation starts when not every decode fits

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        rows = self._pick_decodes(plan, now, self._reserved(now))
        self._pick_prefills(plan, now, rows)
        for seq in self.waiting:
            if seq not in plan.prefills and seq is not plan.long_prefill:
                seq.waited_steps += 1
        return plan

    def _reserved(self, now: float) -> int:
        """Rows kept for the oldest waiting prompt when a slot is free for it, so that
        decodes that fill the forward never starve it (a long one goes by its own call)."""
        if len(self.running) >= self.config.max_seqs:
            return 0
        head = next((s for s in self.waiting if s.verifier.ready(now)), None)
        n = head.verifier.prompt_tokens if head is not None else 0
        return n if n <= self.config.max_prefill_tokens else 0

    def _pick_decodes(self, plan: StepPlan, now: float, reserved: int) -> int:
        cfg, rows = self.config, 0
        ready = [s for s in self.running
                 if not s.verifier.lost and s.verifier.ready(now) and s.next_round is not None]
        if not ready:
            return 0
        start = self._turn % len(ready)
        for seq in ready[start:] + ready[:start]:
            n = decode_rows(seq)
            full = plan.decodes and rows + n > cfg.max_step_tokens - reserved
            if len(plan.decodes) == cfg.max_seqs or full:
                break
            plan.decodes.append(seq)
            rows += n
        self._turn = start + len(plan.decodes)
        return rows

    def _pick_prefills(self, plan: StepPlan, now: float, rows: int) -> None:
        """First prompts in arrival order while a sequence slot is free; lost sessions'
        re-prefills (running sequences) whenever they are due."""
        cfg, prompt_rows = self.config, 0
        lost = [s for s in self.running if s.verifier.lost and s.verifier.ready(now)]
        slots = cfg.max_seqs - len(self.running)
        fresh = [s for s in self.waiting if s.verifier.ready(now)][: max(0, slots)]
        for seq in lost + fresh:
            n = seq.verifier.prompt_tokens
            if n > cfg.max_prefill_tokens:  # its own engine call, before the step's forward
                if plan.long_prefill is None:
                    plan.long_prefill = seq
                    continue
                if seq in fresh:
                    return  # one a step; arrival order: younger prompts wait behind it
                continue
            if prompt_rows + n > cfg.max_prefill_tokens or rows + n > cfg.max_step_tokens:
                return
            plan.prefills.append(seq)
            prompt_rows, rows = prompt_rows + n, rows + n

    def opened(self, seq: Sequence) -> None:
        """A first prefill answered: the sequence runs from the next step."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = Status.RUNNING

    def finish(self, seq: Sequence) -> None:
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
        seq.status = Status.FINISHED



def decode_rows(seq: Sequence) -> int:
    """The most rows a sequence's next round adds to the verifier forward: a tree's budget
    and its root, or the root alone for an AR step (TAPS's gate shut, the drafter away,
    the last token), as the step engine decided it before this step's schedule."""
    return seq.next_round_rows
