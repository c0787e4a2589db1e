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
