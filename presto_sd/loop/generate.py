"""The embedded generation loop over any ``Drafter`` / ``Verifier`` pair (docs/design.md §3).

    verifier.prefill(prompt)             -> anchor b, features F[0:n]
    drafter.prefill(F)
    repeat: drafter.draft(b, n)          -> tree
            verifier.verify(tree, n)     -> accepted a_1..a_k, bonus b', feature delta
            drafter.commit(delta)        # n += k + 1; b = b'

It yields tokens as they commit and records per-round stats. ``method="ar"`` runs plain
AR steps on the verifier: the baseline every method is compared with. Engine faults
(a drafter down, a verifier restarted) are absorbed by the links of ``faults.py``.

The output never runs past the verifier's context window (``Verifier.max_context``:
prompt + output): near it the trees get shallower, then plain AR steps, and the stream
ends with ``finish_reason="length"`` exactly where AR decoding would have to stop.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from presto_sd.engine.drafter import Drafter
from presto_sd.engine.messages import InvalidArgumentError
from presto_sd.engine.verifier import Verifier
from presto_sd.loop.faults import DrafterLink, FaultPolicy, VerifierLink
from presto_sd.loop.taps_feedback import TapsFeedback
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.builders import TreeParams
from presto_sd.method.methods import get_method


@dataclass(frozen=True)
class GenerationParams:
    method: str = "presto-beam"  # "ar" or a tree builder name
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
    draft_s: float  # drafter call, forward + build
    build_s: float  # tree building + scoring, inside draft_s
    verify_s: float
    commit_s: float
    fallback: bool = False  # a plain AR step because the drafter could not give a tree
    gated: bool = False  # a plain AR step because TAPS's draft gate was shut


@dataclass(frozen=True)
class TokenChunk:
    tokens: tuple[int, ...]  # newly committed output tokens (after stop truncation)
    round: RoundStats | None  # None for the prefill's first token
    finish_reason: str | None = None  # set on the last chunk: "eos" | "stop" | "length"


def tau(rounds: Sequence) -> float:
    """Mean tokens committed per verification round (accepted + 1 bonus); 0 without rounds."""
    return sum(r.accepted + 1 for r in rounds) / max(1, len(rounds))


@dataclass
class GenerationResult:
    token_ids: list[int]
    rounds: list[RoundStats]  # or any per-round stats with accepted, tree_size and fallback
    finish_reason: str  # "eos" | "stop" | "length"
    prefill_s: float
    decode_s: float
    text: str = ""  # when the stream carried text (through the orchestrator)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification round (accepted + 1 bonus)."""
        return tau(self.rounds)

    @property
    def mean_tree_size(self) -> float:
        return sum(r.tree_size for r in self.rounds) / max(1, len(self.rounds))

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / max(1e-9, self.prefill_s + self.decode_s)


class _Stopper:
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

    def resume(self, tokens: Sequence[int]) -> None:
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


def stream_generate(
    verifier: Verifier,
    drafter: Drafter | None,
    prompt_ids: list[int],
    params: GenerationParams,
    detokenize: Callable[[list[int]], str] | None = None,
    session_id: str | None = None,
    resume: Sequence[int] = (),
) -> Iterator[TokenChunk]:
    """Yield committed tokens round by round; sessions are closed however it ends.

    ``resume``: the output a client already received from a stream that broke. It counts
    toward ``max_new_tokens`` and the stop conditions; the sessions are prefilled on the
    prompt and it (its last token the pending anchor, as after a verifier restart) and
    the stream goes on from there: greedy, exactly the rest of the unbroken stream. The
    first chunk then carries no tokens (it is the prefill's, ``round`` None).
    """
    method = get_method(params.method)
    if method.needs_drafter and drafter is None:
        raise ValueError(f"method {params.method!r} needs a drafter")
    sid = session_id or uuid.uuid4().hex
    stopper = _Stopper(params, detokenize)
    resume = list(resume)
    if resume:
        stopper.resume(resume)
        if stopper.finish_reason is not None:  # the client has it all but the ending
            yield TokenChunk((), None, stopper.finish_reason)
            return
    target = VerifierLink(verifier, sid, params.sampling, params.faults)
    draft = DrafterLink(drafter, sid, params.faults) if method.needs_drafter else None
    pre = target.prefill(list(prompt_ids), resume)
    try:
        if draft is not None:
            draft.prefill(pre.delta)
        anchor, base = pre.anchor, pre.base
        # the verifier keeps prompt + output <= max_context; the stopper keeps the loop in it
        stopper.clamp(target.max_context() - len(prompt_ids))
        first = () if resume else stopper.accept((anchor,))
        yield TokenChunk(first, None, stopper.finish_reason)
        tree_params = replace(params.tree, method=params.method)
        taps = TapsFeedback(verifier, drafter, seed=sid) if method.sizes_itself else None
        while stopper.finish_reason is None:
            # the bonus token adds one: never draft deeper than the output (and the window) can
            # still use, so the last rounds before the end are shallower trees, then AR steps
            depth = min(tree_params.depth, stopper.remaining - 1)
            t0 = time.perf_counter()
            d = None  # no tree (AR, the last token, TAPS's gate shut, the drafter away): an AR step
            can_draft = draft is not None and depth >= 1
            gated = can_draft and taps is not None and not taps.should_draft()
            wanted = can_draft and not gated
            if wanted:
                tp = tree_params if depth == tree_params.depth else replace(tree_params, depth=depth)
                d = draft.draft(anchor, base, taps.tree_params(tp) if taps else tp)
            t1 = time.perf_counter()
            res = target.verify(base, d.tree if d is not None else None)
            t2 = time.perf_counter()
            if draft is not None:
                draft.commit(res.delta)
            t3 = time.perf_counter()
            size, build_s = (d.tree.size, d.build_s) if d is not None else (0, 0.0)
            if taps is not None:
                tree, raw = (d.tree, d.node_log_acceptance) if d is not None else (None, ())
                taps.observe(tree, raw, base, res.accepted, t1 - t0, t2 - t1, t3 - t2)
            anchor, base = res.bonus, res.base
            fallback = wanted and d is None
            stats = RoundStats(len(res.accepted), size, t1 - t0, build_s, t2 - t1, t3 - t2, fallback, gated)
            yield TokenChunk(stopper.accept(res.new_tokens), stats, stopper.finish_reason)
    finally:
        target.close()
        if draft is not None:
            draft.close()


def generate(
    verifier: Verifier,
    drafter: Drafter | None,
    prompt_ids: list[int],
    params: GenerationParams,
    detokenize: Callable[[list[int]], str] | None = None,
) -> GenerationResult:
    """Run ``stream_generate`` to the end and collect tokens and stats."""
    out = ResultCollector()
    for chunk in stream_generate(verifier, drafter, prompt_ids, params, detokenize):
        out.add(chunk.tokens, chunk.round, chunk.finish_reason)
    return out.result()


class ResultCollector:
    """A stream's chunks, collected into a ``GenerationResult`` (timed from its creation).

    Every way of running a request collects with it: ``generate`` here, the CLI (embedded,
    remote or through the orchestrator) and the orchestrator's ``GenerateBatch``.
    """

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens: list[int] = []
        self.rounds: list = []
        self.text, self.prefill_s, self.finish = "", 0.0, "length"

    def add(self, tokens: Sequence[int], round_stats, finish_reason: str | None, text: str = "") -> None:
        """One chunk: ``round_stats`` None is the prefill's first token."""
        if round_stats is None:
            self.prefill_s = time.perf_counter() - self.t0
        else:
            self.rounds.append(round_stats)
        self.tokens.extend(tokens)
        self.text += text
        self.finish = finish_reason or self.finish

    def result(self) -> GenerationResult:
        total = time.perf_counter() - self.t0
        return GenerationResult(self.tokens, self.rounds, self.finish, self.prefill_s, total - self.prefill_s,
                                self.text)
