"""The step engine and its scheduler on a tiny target: many sequences, one forward a step."""

from __future__ import annotations

import pytest

from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.engine.messages import InvalidArgumentError
from presto_sd.engine.verifier import PrefillCall, VerifierLimits, VerifyCall
from presto_sd.loop.engine import StepEngine
from presto_sd.loop.generate import GenerationParams
from presto_sd.loop.scheduler import SchedulerConfig
from presto_sd.method.builders import TreeParams
from tests.conftest import hf_greedy, make_engines, tiny_drafter_model


class Recording:
    """Proxy of a verifier that records each ``verify_batch``'s calls."""

    def __init__(self, inner) -> None:
        self.inner, self.batches = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify_batch(self, calls):
        self.batches.append(list(calls))
        return self.inner.verify_batch(calls)


def _params(method: str, n: int) -> GenerationParams:
    return GenerationParams(method=method, tree=TreeParams(budget=8, depth=6), max_new_tokens=n)


def _run(engine: StepEngine, seqs: list, max_steps: int = 500, between=None) -> int:
    steps = 0
    while engine.has_unfinished():
        assert steps < max_steps, "the engine did not finish its sequences"
        engine.step()
        steps += 1
        if between is not None:
            between(steps)
    for s in seqs:
        if s.error is not None:
            raise s.error
    return steps


def _tokens(seq) -> list[int]:
    return [t for c in seq.take_chunks() for t in c.tokens]


PROMPTS = [[0, 3, 5, 7], [1, 2], [4, 4, 9, 1, 6, 2], [8], [5, 6, 7, 8, 9]]
METHODS = ["ar", "marginal", "presto-beam", "linear", "presto-best-first"]


def test_a_step_mixes_prompts_ar_steps_and_trees_and_each_output_is_its_own(tiny_target):
    inner, drafter = make_engines(tiny_target)
    verifier = Recording(inner)
    engine = StepEngine(verifier, drafter)
    lengths = [24, 17, 30, 12, 20]
    seqs = [engine.add(p, _params(m, n)) for p, m, n in zip(PROMPTS[:2], METHODS[:2], lengths[:2])]

    def late_arrivals(step: int) -> None:  # prompts that join running sequences' steps
        if step in (2, 4, 5):
            i = len(seqs)
            seqs.append(engine.add(PROMPTS[i], _params(METHODS[i], lengths[i])))

    _run(engine, seqs, between=late_arrivals)
    for seq, prompt, n in zip(seqs, PROMPTS, lengths):
        assert _tokens(seq) == hf_greedy(tiny_target, prompt, n), seq.params.method
    mixed = [b for b in verifier.batches
             if any(isinstance(c, PrefillCall) for c in b)
             and any(isinstance(c, VerifyCall) and c.tree.size == 0 for c in b)
             and any(isinstance(c, VerifyCall) and c.tree.size > 0 for c in b)]
    assert mixed, "no step put a prompt, an AR step and a tree in one forward"
    assert not inner.sessions and not drafter.sessions


def test_a_cancelled_sequence_frees_its_kv_and_leaves_the_others(tiny_target):
    verifier, drafter = make_engines(tiny_target)
    engine = StepEngine(verifier, drafter)
    keep = [engine.add(PROMPTS[0], _params("marginal", 30)), engine.add(PROMPTS[2], _params("ar", 30))]
    gone = engine.add(PROMPTS[1], _params("presto-beam", 30))
    for _ in range(3):
        engine.step()
    assert gone.seq_id in verifier.sessions and gone.seq_id in drafter.sessions
    used = _slots_used(verifier)
    engine.cancel(gone.seq_id)
    assert gone.finished and gone.seq_id not in verifier.sessions and gone.seq_id not in drafter.sessions
    assert _slots_used(verifier) == used - 1
    _run(engine, keep)
    assert _tokens(keep[0]) == hf_greedy(tiny_target, PROMPTS[0], 30)
    assert _tokens(keep[1]) == hf_greedy(tiny_target, PROMPTS[2], 30)
    assert not verifier.sessions and not drafter.sessions
    assert verifier.kv_store.nbytes == 0  # every page freed


def _slots_used(verifier: HFVerifier) -> int:
    return sum(len(p._used) for pages in verifier.kv_store.pages.values() for p in pages)


def test_no_waiting_prompt_starves(tiny_target):
    """One prompt's tokens a step and two sequences at once: prompts start in arrival order,
    each as soon as a slot is free, while the running ones keep decoding."""
    verifier, drafter = make_engines(tiny_target)
    engine = StepEngine(verifier, drafter, SchedulerConfig(max_seqs=2, max_prefill_tokens=6))
    seqs = [engine.add(p, _params("marginal", 6)) for p in PROMPTS]
    started: list[int] = []

    def record(step: int) -> None:
        for i, s in enumerate(seqs):
            if i not in started and s.status.value != "waiting":
                started.append(i)

    steps = _run(engine, seqs, between=record)
    assert started == list(range(len(PROMPTS)))
    for seq, prompt in zip(seqs, PROMPTS):
        assert _tokens(seq) == hf_greedy(tiny_target, prompt, 6)
    # the bound: a prompt waits for the ones before it to take a slot, and a slot frees
    # after at most max_new_tokens rounds of a running sequence
    assert all(s.waited_steps <= 6 * i for i, s in enumerate(seqs)), [s.waited_steps for s in seqs]
    assert steps <= 6 * len(PROMPTS) + len(PROMPTS)


def test_a_refused_call_in_a_batch_leaves_the_others(tiny_target):
    verifier, drafter = make_engines(tiny_target)
    engine = StepEngine(verifier, drafter)
    good = [engine.add(PROMPTS[0], _params("marginal", 16)), engine.add(PROMPTS[3], _params("ar", 16))]
    engine.step()
    bad = engine.add([0, 99, 1], _params("marginal", 16))  # token 99: outside the vocabulary of 16
    lost = good[0]
    verifier.close(lost.seq_id)  # its session gone behind its back: NOT_FOUND, then a re-prefill
    _run_ignoring(engine, bad)
    assert isinstance(bad.error, InvalidArgumentError) and bad.finished
    assert _tokens(good[0]) == hf_greedy(tiny_target, PROMPTS[0], 16)
    assert _tokens(good[1]) == hf_greedy(tiny_target, PROMPTS[3], 16)
    assert not verifier.sessions and not drafter.sessions


def _run_ignoring(engine: StepEngine, failing) -> None:
    while engine.has_unfinished():
        engine.step()
    assert failing.error is not None


def test_a_prompt_refused_for_room_waits_for_a_finish(tiny_target):
    """A KV budget that holds one session: the second prompt waits (it is not refused) and
    runs when the first finishes."""
    drafter_model = tiny_drafter_model(tiny_target)
    _, drafter = make_engines(tiny_target, drafter_model)
    probe = HFVerifier(tiny_target, drafter_model.config.target_layer_ids, kv_min_capacity=64)
    one_slot = probe.kv_store.placement_bytes([64])
    verifier = HFVerifier(tiny_target, drafter_model.config.target_layer_ids, kv_min_capacity=64,
                          max_kv_bytes=one_slot, limits=VerifierLimits(max_context=60))
    engine = StepEngine(verifier, drafter)
    a = engine.add(PROMPTS[0], _params("marginal", 10))
    engine.step()
    b = engine.add(PROMPTS[1], _params("ar", 10))
    _run(engine, [a, b])
    assert _tokens(a) == hf_greedy(tiny_target, PROMPTS[0], 10)
    assert _tokens(b) == hf_greedy(tiny_target, PROMPTS[1], 10)


def test_a_lone_prompt_that_cannot_fit_is_refused(tiny_target):
    verifier, drafter = make_engines(tiny_target)
    small = HFVerifier(tiny_target, (0, 2), limits=VerifierLimits(max_context=8))
    engine = StepEngine(small, drafter)
    seq = engine.add(list(range(10)), _params("marginal", 4))
    engine.step()
    assert seq.finished and seq.error is not None and seq.error.code == "RESOURCE_EXHAUSTED"


@pytest.mark.parametrize("bad", [dict(max_seqs=0), dict(max_step_tokens=0), dict(max_step_tokens=10**6)])
def test_scheduler_config_is_checked(bad):
    with pytest.raises(ValueError):
        SchedulerConfig(**bad)


def test_the_step_engine_reports_the_load_a_tree_joins(tiny_target):
    """TAPS under load prices a tree against the forward it shares: the engine's last step,
    less the asking sequence's rows; alone there is none."""
    verifier, drafter = make_engines(tiny_target)
    engine = StepEngine(verifier, drafter)
    seqs = [engine.add(p, _params("ar", 8)) for p in PROMPTS[:3]]
    engine.step()  # three prompts in one forward
    assert engine.last_calls == 3 and engine.last_rows == sum(len(p) for p in PROMPTS[:3])
    engine.step()  # three AR steps
    shared = engine.shared_forward(rows=1)
    assert shared is not None and shared.others_tokens == 2.0
    _run(engine, seqs)
    lone = StepEngine(verifier, drafter)
    one = lone.add(PROMPTS[0], _params("ar", 4))
    lone.step()
    lone.step()
    assert lone.shared_forward(rows=1) is None
    _run(lone, [one])


def test_trees_that_fill_the_forward_leave_room_for_the_oldest_prompt(tiny_target):
    """Decodes whose trees fill the step's rows would keep a new prompt out while they run:
    the oldest waiting prompt's rows are kept free, so it starts at the next step."""
    verifier, drafter = make_engines(tiny_target)
    engine = StepEngine(verifier, drafter, SchedulerConfig(max_step_tokens=20, max_prefill_tokens=8))
    seqs = [engine.add(p, _params("marginal", 40)) for p in PROMPTS[:3] if len(p) <= 4]
    for _ in range(4):
        engine.step()
    assert all(s.status.value == "running" for s in seqs)
    late = engine.add([2, 7, 1], _params("marginal", 8))
    engine.step()
    assert late.status.value == "running" and late.waited_steps == 0
    _run(engine, [*seqs, late])
    assert _tokens(late) == hf_greedy(tiny_target, [2, 7, 1], 8)


def test_a_sequence_that_fails_in_its_draft_is_reported_by_the_step(tiny_target):
    """A refusal that is not a fault (here the drafter refuses the session's prefill) ends
    that sequence with its error, in the step's answer, so a server hands it on; the other
    sequence goes on."""
    verifier, inner = make_engines(tiny_target)

    class Refusing:
        def __getattr__(self, name):
            return getattr(inner, name)

        def prefill(self, session_id, delta, restart=False):
            if session_id == "bad":
                raise InvalidArgumentError("refused")
            return inner.prefill(session_id, delta, restart)

    engine = StepEngine(verifier, Refusing())
    bad = engine.add(PROMPTS[0], _params("marginal", 8), seq_id="bad")
    good = engine.add(PROMPTS[1], _params("marginal", 8), seq_id="good")
    failed_in = None
    while engine.has_unfinished():
        reported = engine.step()
        if bad.error is not None and failed_in is None:
            failed_in = reported  # the step in which it failed must report it
    assert failed_in is not None and bad in failed_in and isinstance(bad.error, InvalidArgumentError)
    assert good.error is None and _tokens(good) == hf_greedy(tiny_target, PROMPTS[1], 8)
