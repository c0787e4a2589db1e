"""One request as the scheduler holds it: its params, its stop rule, its output, and the
two sides of its engine sessions (``faults.py``: what they keep to survive engine faults).

A ``Sequence`` is plain state; the step engine (``engine.py``) decides what each one does
in a step and feeds the answers back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from presto_sd.engine.messages import InvalidArgumentError
from presto_sd.loop.faults import DrafterSide, FaultPolicy, VerifierSide
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.builders import TreeParams
from presto_sd.method.methods import DEFAULT_METHOD, Method, get_method


@dataclass(frozen=True)
class GenerationParams:
    method: str = DEFAULT_METHOD  # "ar" or a tree builder (the tree's shape: ``tree``)
    tree: TreeParams = field(default_factory=TreeParams)
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    faults: FaultPolicy = field(default_factory=FaultPolicy)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens}: must be >= 1")


@dataclass(frozen=True)
class RoundStats:
    accepted: int  # accepted draft tokens (tau counts these + 1)
    tree_size: int  # draft nodes verified, root excluded
    draft_s: float  # the step's drafter call(s), forward + build
    build_s: float  # this sequence's tree building + scoring, inside draft_s
    verify_s: float  # the step's verifier call
    commit_s: float  # handing the round's features on: logged, they travel with the next draft
    fallback: bool = False  # a plain AR step because the drafter could not give a tree
    gated: bool = False  # a plain AR step because TAPS's draft gate was shut


@dataclass(frozen=True)
class TokenChunk:
    tokens: tuple[int, ...]  # newly committed output tokens (after stop truncation)
    round: RoundStats | None  # None for the prefill's first token
    finish_reason: str | None = None  # set on the last chunk: "eos" | "stop" | "length"


class Stopper:
    """Truncates the stream at EOS, a stop string, ``max_new_tokens`` or the context window."""

    def __init__(self, params: GenerationParams, detokenize: Callable[[list[int]], str] | None):
        if params.stop_strings and detokenize is None:
            raise ValueError("stop_strings need a detokenize function")
        self.params, self.detokenize = params, detokenize
        self.out: list[int] = []
        self.finish_reason: str | None = None
        self.limit = params.max_new_tokens  # output tokens allowed: the window may lower it

    @property
    def remaining(self) -> int:
        return self.limit - len(self.out)

    def clamp(self, room: int) -> None:
        """At most ``room`` output tokens in all (what the context window leaves the prompt)."""
        self.limit = min(self.limit, room)
        if self.remaining <= 0 and self.finish_reason is None:
            self.finish_reason = "length"

    def resume(self, tokens: Seq[int]) -> None:
        """Output a client already has: counted as if this stream had produced it."""
        kept = self.accept(tuple(tokens))
        if len(kept) < len(tokens):
            raise InvalidArgumentError(
                f"resume_token_ids: {len(tokens)} tokens, but the output ends ({self.finish_reason}) "
                f"at token {len(kept) - 1} (max_new_tokens {self.params.max_new_tokens})")

    def accept(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        kept = []
        for t in tokens:
            self.out.append(t)
            kept.append(t)
            if t in self.params.stop_token_ids:
                self.finish_reason = "eos"  # an EOS inside an accepted path ends it there
            elif self.params.stop_strings and any(
                s in self.detokenize(self.out) for s in self.params.stop_strings
            ):
                self.finish_reason = "stop"
            elif self.remaining == 0:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        return tuple(kept)


class Status(enum.Enum):
    WAITING = "waiting"  # its verifier session is not open yet
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request: its prompt, params and output, the state of its sessions, its chunks."""

    def __init__(self, seq_id: str, prompt_ids: Seq[int], params: GenerationParams,
                 detokenize: Callable[[list[int]], str] | None = None, resume: Seq[int] = (),
                 has_drafter: bool = True) -> None:
        self.seq_id = seq_id
        self.params = params
        self.method: Method = get_method(params.method)
        if self.method.needs_drafter and not has_drafter:
            raise ValueError(f"method {params.method!r} needs a drafter")
        self.prompt_ids = tuple(prompt_ids)
        self.stopper = Stopper(params, detokenize)
        self.resumed = bool(resume)
        if resume:
            self.stopper.resume(resume)
        self.verifier = VerifierSide(self.prompt_ids, resume, params.sampling, params.faults)
        self.drafter = DrafterSide(params.faults) if self.method.needs_drafter else None
        self.tree_params = params.tree
        self.taps = None  # TapsFeedback, made when the first round needs it
        # the step engine's decision for the next round (a tree or an AR step), made before
        # the scheduler picks, and the most verifier rows that round may take
        self.next_round = None
        self.next_round_rows = 1
        self.status = Status.WAITING
        self.anchor, self.base = -1, 0
        self.windowed = False  # the stopper knows the verifier's context window
        self.chunks: list[TokenChunk] = []  # produced, not yet taken by the consumer
        self.error: BaseException | None = None
        self.waited_steps = 0  # steps spent waiting for a prefill (the starvation bound's count)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.stopper.finish_reason

    def take_chunks(self) -> list[TokenChunk]:
        out, self.chunks = self.chunks, []
        return out

    def depth_left(self) -> int:
        """The deepest tree this round can use: the bonus token adds one, so never draft
        deeper than the output (and the window) can still take."""
        return min(self.tree_params.depth, self.stopper.remaining - 1)
