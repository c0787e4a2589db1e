"""Verifier replicas of one pool compute alike, or the pool does not form.

A session whose home replica goes down is re-homed on another and rebuilt there by a
re-prefill of its committed tokens; it continues bitwise only where both replicas compute
the same way: the same target, dtype, weights, decoder, attention kernel and prefill chunk
(a prompt's KV rounds by its chunks). ``Orchestrator.start`` asks every verifier replica
and refuses a mismatch by name."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from orchestrator.actors import ReplicaSpec
from orchestrator.orchestrator import Orchestrator
from orchestrator.routing import ReplicaMismatchError, arithmetic_mismatch
from presto_sd.engine.verifier import VerifierInfo

INFO = VerifierInfo(model="tiny-llama", dtype="float32", device="cpu", vocab_size=16, eos_token_ids=(1,),
                    target_layer_ids=(0, 2), row_invariant=True, decoder="owned", weights="dense",
                    attention_kernel="sdpa", prefill_chunk=512)


def test_replicas_that_compute_alike_agree_whatever_else_differs():
    other = dataclasses.replace(INFO, device="cpu:1", eos_token_ids=(2,), self_draft_block=4)
    assert arithmetic_mismatch([("a", INFO), ("b", other), ("c", INFO)]) is None


ODD = [("prefill_chunk", 64, 64), ("dtype", "bfloat16", "bfloat16"), ("weights", "gguf-int4", "gguf-int4"),
       ("attention_kernel", "eager", "eager"), ("decoder", "transformers", "transformers"),
       ("model", "another", "another"), ("row_invariant", False, False), ("device", "cuda:0", "cuda")]


@pytest.mark.parametrize("field, value, said", ODD)
def test_a_replica_that_computes_otherwise_is_named_with_what_differs(field, value, said):
    odd = dataclasses.replace(INFO, **{field: value})
    message = arithmetic_mismatch([("a", INFO), ("b", INFO), ("c", odd)])
    assert message is not None and message.startswith("verifier replica c differs from a: ")
    assert f"{field} {said!r} (not {getattr(INFO, field)!r})" in message


def tiny_verifier(prefill_chunk: int):
    from presto_sd.embedded.hf_verifier import HFVerifier
    from tests.conftest import tiny_drafter_model, tiny_llama

    target = tiny_llama()
    return HFVerifier(target, tiny_drafter_model(target).config.target_layer_ids, name="tiny-llama",
                      prefill_chunk=prefill_chunk)


def tiny_drafter():
    from tests.conftest import make_engines, tiny_llama

    return make_engines(tiny_llama())[1]


def spec(kind: str, name: str, factory) -> ReplicaSpec:
    return ReplicaSpec(kind, name, factory, direct=True)  # in this process: no actor to start


def test_the_orchestrator_refuses_verifier_replicas_with_other_prefill_chunks(ray_runtime):
    drafters = [spec("drafter", "d0", tiny_drafter)]
    refused = r"replica v1 differs from v0: prefill_chunk 64 \(not 512\)"
    with pytest.raises(ReplicaMismatchError, match=refused):
        Orchestrator.start(drafters, [spec("verifier", "v0", functools.partial(tiny_verifier, 512)),
                                      spec("verifier", "v1", functools.partial(tiny_verifier, 64))])
    orch = Orchestrator.start(drafters, [spec("verifier", f"v{i}", functools.partial(tiny_verifier, 512))
                                         for i in range(2)])
    try:
        assert orch.verifier.info().prefill_chunk == 512
    finally:
        orch.shutdown()


def _generate(orch: Orchestrator, prompt: list[int], n: int) -> list[int]:
    from orchestrator.requests import GenerateJob
    from presto_sd.loop.generate import GenerationParams
    from presto_sd.method.builders import TreeParams

    params = GenerationParams(method="marginal", tree=TreeParams(budget=8, depth=4), max_new_tokens=n)
    return [t for chunk in orch.stream(GenerateJob(tuple(prompt), params)) for t in chunk.tokens]


def test_a_replica_back_computing_otherwise_gets_sessions_only_while_none_alike_is(ray_runtime):
    """v1 goes down and comes back another process with another prefill chunk (a pod replaced
    by a rolling upgrade, say): it is asked before it serves and named; sessions go to v0,
    which computes alike, while v0 is healthy, and to v1 (counted) only when v0 is not, so a
    rolling upgrade never leaves the pool without a replica. Fixed, v1 is alike again."""
    from presto_sd.engine import calls
    from presto_sd.engine.messages import VerifierUnavailableError
    from tests.conftest import hf_greedy, tiny_llama

    verifiers = [spec("verifier", f"v{i}", functools.partial(tiny_verifier, 512)) for i in range(2)]
    orch = Orchestrator.start([spec("drafter", "d0", tiny_drafter)], verifiers)
    v0, v1 = orch.verifiers.replicas
    target, prompts = tiny_llama(), ([0, 3, 5, 7], [0, 9, 2])
    try:
        assert _generate(orch, prompts[0], 12) == hf_greedy(target, prompts[0], 12)
        v1.failed("UNAVAILABLE")  # down; its process replaced meanwhile
        v1.engine.local.engine = tiny_verifier(64)
        served, real_call = [], v1.engine.call  # what v1's engine is asked, Info aside
        v1.engine.call = lambda c, **k: (isinstance(c, calls.Info) or served.append(c), real_call(c, **k))[1]
        v1.down_until = 0.0  # its back-off over
        with pytest.raises(VerifierUnavailableError, match=r"replica v1 came back computing otherwise .*: "
                           r"verifier replica v1 differs from v0: prefill_chunk 64 \(not 512\)"):
            v1.call(calls.Info())
        assert v1.healthy and not v1.recheck and "prefill_chunk 64" in v1.mismatch
        assert orch.metrics.tallies["error:verifier:MISMATCH"] == 1
        pool = orch.verifier
        assert pool.home("held") is v0  # v0 busier: least-loaded alone would pick v1
        for prompt in prompts:  # v0 computes alike and is healthy: every session homes there
            assert _generate(orch, prompt, 12) == hf_greedy(target, prompt, 12)
        assert not served
        assert pool.home("s") is v0
        pool.close("held")
        v0.failed("UNAVAILABLE")  # now only v1 is healthy: the session goes on there, counted
        assert pool.home("s") is v1 and orch.metrics.tallies["fallback:verifier_rehome_mismatch"] == 1
        v0.down_until = 0.0
        assert pool.home("s") is v0  # v0 back (and asked again: alike): the session returns
        pool.close("s")
        v0.failed("UNAVAILABLE")
        for prompt in prompts:  # a request with no replica alike healthy is served, not refused
            assert _generate(orch, prompt, 12) == hf_greedy(target, prompt, 12)
        assert served
        v1.engine.local.engine = tiny_verifier(512)  # fixed, and back after a failure
        v1.failed("UNAVAILABLE")
        v1.down_until = 0.0
        assert v1.call(calls.Info()).value.prefill_chunk == 512
        assert v1.healthy and not v1.recheck and v1.mismatch is None
    finally:
        orch.shutdown()


def test_a_replica_that_forgets_a_session_is_asked_again_before_it_serves(ray_runtime):
    """An unknown session (a single call's error, or a batch item's) says the replica may
    have restarted without the orchestrator seeing it down: its arithmetic is asked again
    before its next call."""
    from presto_sd.engine import calls
    from presto_sd.engine.messages import SessionNotFoundError
    from presto_sd.engine.verifier import VerifyCall
    from presto_sd.method.tree import TokenTree

    verifiers = [spec("verifier", f"v{i}", functools.partial(tiny_verifier, 512)) for i in range(2)]
    orch = Orchestrator.start([spec("drafter", "d0", tiny_drafter)], verifiers)
    v0, v1 = orch.verifiers.replicas
    try:
        asked = []
        check = v1.check
        v1.check = lambda replica, timeout_s: (asked.append(replica.name), check(replica, timeout_s))[1]
        with pytest.raises(SessionNotFoundError):
            v1.call(calls.Step("nobody", 0, 3))
        assert v1.recheck and v1.healthy  # not down: asked before its next call
        v1.call(calls.Info())
        assert asked == ["v1"] and not v1.recheck and v1.mismatch is None
        orch.verifier.homes["nobody"] = v1  # a session it held, as far as the orchestrator knows
        answers = orch.verifier.verify_batch([VerifyCall("nobody", 0, TokenTree.root_only(3))])
        assert isinstance(answers[0], SessionNotFoundError) and v1.recheck
    finally:
        orch.shutdown()
