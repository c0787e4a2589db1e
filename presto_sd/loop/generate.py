"""Generation of one request: a batch of one through the step engine (docs/design.md §3).

    verifier.prefill(prompt)                       -> anchor b, features F[0:n]
    repeat: drafter.draft(b, n, + the last delta)  -> tree
            verifier.verify(tree, n)               -> accepted a_1..a_k, bonus b', delta
            n += k + 1; b = b'

That is what ``StepEngine.step`` (``engine.py``) runs for every sequence its scheduler
picks; ``stream_generate`` steps an engine that holds this one request, so embedded
generation and a server run the same code. ``method="ar"`` runs plain AR steps on the
verifier: the baseline every method is compared with. Engine faults (a drafter down, a
verifier restarted) are absorbed as ``faults.py`` says.

The output never runs past the verifier's context window (``Verifier.max_context``:
prompt + output): near it the trees get shallower, then plain AR steps, and the stream
ends with ``finish_reason="length"`` exactly where AR decoding would have to stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from presto_sd.engine.drafter import Drafter
from presto_sd.engine.verifier import Verifier
from presto_sd.loop.engine import StepEngine
from presto_sd.loop.sequence import GenerationParams, RoundStats, TokenChunk

__all__ = ["GenerationParams", "GenerationResult", "ResultCollector", "RoundStats", "TokenChunk",
           "generate", "stream_generate", "tau"]


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
    engine = StepEngine(verifier, drafter)
    seq = engine.add(prompt_ids, params, detokenize, session_id, resume)
    try:
        while True:
            yield from seq.take_chunks()
            if seq.error is not None:
                raise seq.error
            if seq.finished:
                return
            if not engine.step():  # every engine call waits out a retry pause
                time.sleep(engine.idle_s())
    finally:
        engine.cancel(seq.seq_id)  # a stream closed early: both sessions are closed


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
