"""A re-prefill goes on exactly as the unbroken session: its output is fed as ``decoded``.

A verifier restart (the loop re-prefills every committed token) and a resumed stream (a
client's ``resume_token_ids``) open a session on prompt + output. Prefilled as one prompt
chunk, the output's rows round their own way (a chunk's attention is not the decode rows'):
on the real target in bf16, 9 of 12 resumed streams parted from the unbroken ones, first at
output token 18-113 (2026-12-06). With ``PrefillCall.decoded`` the verifier computes the
output as the AR steps did (chains, row-invariant), so every later row is bitwise.
"""

from __future__ import annotations

import pytest
import torch

from presto_sd.embedded import target_runner
from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.engine.messages import InvalidArgumentError
from presto_sd.engine.verifier import PrefillCall
from presto_sd.method.tree import TokenTree
from presto_sd.models.invariant import KEY_BLOCK
from tests.conftest import in_dtype
from tests.test_invariance import PROMPT, ar_steps, dtypes_here, recording


def next_row(v: HFVerifier, call: PrefillCall, batched: bool) -> torch.Tensor:
    """The hidden row of the AR step after a re-prefill ``call``."""
    (answer,) = v.verify_batch([call]) if batched else [v.prefill(
        call.session_id, list(call.token_ids), anchor=call.anchor, decoded=call.decoded)]
    assert answer.anchor == call.anchor and answer.base == len(call.token_ids)
    assert answer.delta.features.shape[0] == len(call.token_ids)
    seen = recording(v)
    v.verify(call.session_id, answer.base, TokenTree.root_only(call.anchor))
    del v.runner.forward
    return seen[-1][0]


@pytest.mark.parametrize("batched", [False, True], ids=["prefill", "verify_batch"])
@pytest.mark.parametrize("dtype", dtypes_here())
def test_a_reprefill_of_decoded_output_goes_on_bitwise(tiny_target, dtype, batched, two_threads, monkeypatch):
    """Prompt + 8 decoded tokens, re-prefilled with ``decoded=8`` (the output in chains of 2:
    the pieces join up), then one AR step: its row is the unbroken session's, bitwise."""
    monkeypatch.setattr(target_runner, "CHAIN_KEYS", 2 * KEY_BLOCK)  # 8 rows halved to 2 at 64 keys
    v = HFVerifier(in_dtype(tiny_target, dtype), (0, 2))
    out, rows = ar_steps(v, PROMPT, 10)  # out[0] is the prefill's anchor; rows[i] the step on out[i]
    call = PrefillCall("re", (*PROMPT, *out[:8]), anchor=out[8], restart=False, decoded=8)
    assert torch.equal(next_row(v, call, batched), rows[8])


def test_decoded_is_checked_before_anything_changes(tiny_target):
    v = HFVerifier(tiny_target, (0, 2))
    for decoded in (-1, len(PROMPT), len(PROMPT) + 1):  # the prompt keeps at least one token
        with pytest.raises(InvalidArgumentError, match="prefill.decoded"):
            v.prefill("s", PROMPT, anchor=1, decoded=decoded)
        (answer,) = v.verify_batch([PrefillCall("s", tuple(PROMPT), anchor=1, decoded=decoded)])
        assert isinstance(answer, InvalidArgumentError)
        assert len(v.sessions) == 0 and v.sessions.in_use_bytes() == 0


def test_the_loop_sends_the_output_as_decoded():
    from presto_sd.loop.faults import FaultPolicy, VerifierSide
    from presto_sd.method.acceptance import SamplingParams

    side = VerifierSide([1, 2, 3], [7, 8, 9], SamplingParams(), FaultPolicy())
    first = side.prefill_call("s")  # a resumed stream: its last token is the anchor
    assert (first.token_ids, first.anchor, first.decoded) == ((1, 2, 3, 7, 8), 9, 2)
    side.prefilled(9)
    side.committed([4, 5])
    again = side.prefill_call("s")  # after a verifier restart: every committed token
    assert (again.token_ids, again.anchor, again.decoded) == ((1, 2, 3, 7, 8, 9, 4), 5, 4) and again.restart


@pytest.mark.smollm2
def test_smollm2_a_resumed_stream_is_the_rest_of_the_unbroken_one(two_threads):
    """The real target in its default dtype: a stream resumed after 10 tokens goes on as the
    unbroken one (GSM8K test item 1, held out: parted at output token 20 before ``decoded``)."""
    from presto_sd.embedded.stack import build_embedded
    from presto_sd.loop.generate import GenerationParams, generate, stream_generate
    from presto_sd.models.loading import encode_messages

    stack = build_embedded(device=torch.device("cpu"))
    question = ("A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total "
                "does it take?")
    prompt = encode_messages(stack.tokenizer, [{"role": "user", "content": question}], True)
    for method in ("ar", "presto-best-first"):
        params = GenerationParams(method, max_new_tokens=40, stop_token_ids=stack.verifier.eos_token_ids)
        full = generate(stack.verifier, stack.drafter, prompt, params).token_ids
        stream = stream_generate(stack.verifier, stack.drafter, prompt, params, resume=full[:10])
        rest = [t for chunk in stream for t in chunk.tokens]
        assert full[:10] + rest == full, method


def test_decoded_crosses_the_wire():
    from verifier_service import wire

    call = PrefillCall("s", (1, 2, 3, 4), anchor=5, restart=True, decoded=2)
    msg = type(wire.prefill_call_to_pb(call)).FromString(wire.prefill_call_to_pb(call).SerializeToString())
    assert wire.prefill_call_from_pb(msg) == call
    assert wire.prefill_call_from_pb(wire.prefill_call_to_pb(PrefillCall("s", (1,)))).decoded == 0


def test_a_batched_prompt_longer_than_a_chunk_is_chunked_as_prefill_chunks_it(tiny_target, two_threads):
    """A scheduler may batch a prompt longer than the verifier's chunk (its max_prefill_tokens
    set above prefill_chunk); a re-prefill of it runs in chunks. So the batch prefills it in
    chunks too: the session's next row is a chunked prefill's, bitwise."""
    v = HFVerifier(tiny_target, (0, 2), prefill_chunk=4)
    alone = v.prefill("a", PROMPT)
    (batched,) = v.verify_batch([PrefillCall("b", tuple(PROMPT))])
    assert batched.anchor == alone.anchor and torch.equal(batched.delta.features, alone.delta.features)
    rows = [next_step_row(v, sid, r) for sid, r in (("a", alone), ("b", batched))]
    assert torch.equal(*rows)


def next_step_row(v: HFVerifier, session_id: str, r) -> torch.Tensor:
    seen = recording(v)
    v.verify(session_id, r.base, TokenTree.root_only(r.anchor))
    del v.runner.forward
    return seen[-1][0]


def test_a_batch_that_fails_opens_no_chunked_prompt(tiny_target, monkeypatch):
    """The chunked prompts of a batch run after its forward: a forward that fails leaves
    every session of the batch unopened, theirs too."""
    v = HFVerifier(tiny_target, (0, 2), prefill_chunk=4)

    def broken(*args, **kwargs):
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(v, "_run", broken)
    with pytest.raises(RuntimeError):
        v.verify_batch([PrefillCall("short", (1, 2)), PrefillCall("long", tuple(PROMPT))])
    assert len(v.sessions) == 0 and v.sessions.in_use_bytes() == 0


def test_a_negative_decoded_is_refused_before_the_wire():
    from verifier_service import wire

    with pytest.raises(InvalidArgumentError, match="prefill.decoded"):
        wire.prefill_call_to_pb(PrefillCall("s", (1, 2), decoded=-1))
