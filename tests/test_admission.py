"""Refused calls change nothing; memory is admitted by bytes; long prefills are chunked.

Issue 18, defects 4 and 9: a call either takes effect and answers, or answers an error and
leaves every session as it was (a response over ``--max-message-mb`` included), and the
engines' KV bytes stay inside a budget, refused before anything is allocated.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from presto_pb.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.embedded.memory import KV_SHARE, free_memory, kv_budget
from presto_sd.engine.messages import FeatureDelta, LimitExceededError, VerifierUnavailableError
from presto_sd.engine.verifier import VerifyCall
from presto_sd.loop.generate import GenerationParams, generate
from presto_sd.method.builders import TreeParams
from presto_sd.method.tree import TokenTree
from presto_sd.rpc.client import make_channel
from presto_sd.rpc.server import ServerConfig
from tests.conftest import hf_greedy, make_engines
from tests.rpc_util import LocalServer
from verifier_service import wire
from verifier_service.remote import RemoteVerifier

CODE = grpc.StatusCode
PROMPT = [0, 3, 5, 7, 2, 9, 4]
PER = 512  # KV bytes of a position of the tiny target (conftest)


def wide_llama() -> LlamaForCausalLM:
    """A tiny-vocabulary Llama whose feature rows are wide: 4 layers x 1024 x 4 B = 16 KiB a token,
    so a 64-token prompt's features (1 MiB) or a 64-deep accepted path pass a 1 MiB message cap."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16, hidden_size=1024, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def wide_target() -> LlamaForCausalLM:
    return wide_llama()


def _code(call) -> CODE:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def _step(stub, sid: str, base: int, anchor: int):
    ref = common_pb2.SessionRef(session_id=sid, base=base)
    return stub.Step(verifier_pb2.StepRequest(session=ref, anchor=anchor), timeout=30)


# -- defect 4: a response over the message cap is refused and changes nothing -----------
def test_a_response_over_the_message_cap_changes_nothing(wide_target):
    server = LocalServer("verifier", ServerConfig(max_message_mb=1, drain_s=0, grace_s=0))
    server.start(HFVerifier(wide_target, (0, 1, 2, 3)))
    stub = verifier_pb2_grpc.VerifierServiceStub(make_channel(server.address))
    engine = server.server.servicer.engine
    prompt = [1 + i % 15 for i in range(20)]
    ar = hf_greedy(wide_target, prompt, 70)
    try:
        # a prefill whose features pass 1 MiB: refused, and no session is left open
        long_prompt = [1 + i % 15 for i in range(100)]
        code, details = _code(lambda: stub.Prefill(verifier_pb2.VerifierPrefillRequest(
            session_id="big", token_ids=long_prompt), timeout=30))
        assert code == CODE.RESOURCE_EXHAUSTED, details
        assert len(engine.sessions) == 0
        code, _ = _code(lambda: _step(stub, "big", len(long_prompt), 1))
        assert code == CODE.NOT_FOUND

        ok = stub.Prefill(verifier_pb2.VerifierPrefillRequest(session_id="s", token_ids=prompt), timeout=30)
        assert ok.anchor == ar[0]
        # restarting "s" with that prompt is refused too: "s" stays as it was
        code, details = _code(lambda: stub.Prefill(verifier_pb2.VerifierPrefillRequest(
            session_id="s", token_ids=long_prompt, restart=True), timeout=30))
        assert code == CODE.RESOURCE_EXHAUSTED, details
        # a verify whose accepted path (65 rows of 16 KiB) passes the cap: refused, nothing committed
        chain = common_pb2.TokenTree(tokens=ar[:65], parents=list(range(-1, 64)))
        ref = common_pb2.SessionRef(session_id="s", base=ok.base)
        verify = verifier_pb2.VerifyRequest(session=ref, tree=chain)
        code, details = _code(lambda: stub.Verify(verify, timeout=30))
        assert code == CODE.RESOURCE_EXHAUSTED, details
        batch = verifier_pb2.VerifyBatchRequest(items=[verifier_pb2.VerifyRequest(session=ref, tree=chain)])
        code, details = _code(lambda: stub.VerifyBatch(batch, timeout=30))
        assert code == CODE.RESOURCE_EXHAUSTED, details
        # the session goes on from where it was, as if the refused calls never happened
        base, anchor, out = ok.base, ok.anchor, [ok.anchor]
        small = common_pb2.TokenTree(tokens=ar[:9], parents=list(range(-1, 8)))
        res = stub.Verify(verifier_pb2.VerifyRequest(session=ref, tree=small), timeout=30)
        assert list(res.accepted) == ar[1:9]
        out += [*res.accepted, res.bonus]
        base, anchor = res.base, res.bonus
        while len(out) < 20:
            res = _step(stub, "s", base, anchor)
            out.append(res.bonus)
            base, anchor = res.base, res.bonus
        assert out == ar[:20]
    finally:
        server.stop()


def test_the_response_bounds_hold_for_real_responses(tiny_target):
    verifier, _ = make_engines(tiny_target)
    row = verifier.feature_row_bytes
    assert row == 2 * 32 * 4  # two target layers x hidden 32 x fp32
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 300):
        prompt = torch.randint(0, 16, (n,), generator=g).tolist()
        pre = verifier.prefill(f"p{n}", prompt)
        assert wire.prefill_result_to_pb(pre).ByteSize() <= wire.prefill_response_bound(n, row)
        base, anchor = pre.base, pre.anchor
        for size in (0, 3, 40):
            greedy = hf_greedy(tiny_target, [*prompt, anchor], size) if size else []
            tree = TokenTree.from_lists([anchor, *greedy], list(range(-1, size)))  # a chain: all accepted
            call = VerifyCall(f"p{n}", base, tree, want_node_probs=size == 3)
            res = verifier.verify(call.session_id, base, tree, call.want_node_probs)
            assert wire.verify_result_to_pb(res).ByteSize() <= wire.verify_response_bound(call, row)
            base, anchor = res.base, res.bonus


# -- defect 9: KV bytes admitted against a budget, before anything is allocated ----------
class CountingVerifier(HFVerifier):
    """Counts target forwards (a refused call must run none) and can log them and slow them."""

    def __init__(self, *args, delay_s: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forwards, self.delay_s, self.events = 0, delay_s, []
        forward = self.runner.forward

        def counted(segments, input_ids, positions, mask_rows=()):
            self.forwards += 1
            self.events.append(("step" if len(input_ids) == 1 else "chunk", time.monotonic()))
            if len(input_ids) > 1:
                time.sleep(self.delay_s)
            return forward(segments, input_ids, positions, mask_rows)

        self.runner.forward = counted


def _committed_bytes(kv) -> int:
    return sum(k.nbytes + v.nbytes for k, v in (kv.committed(i) for i in range(len(kv.keys))))


SLOT = 64 * PER  # a slot of the smallest class these tests give the verifier (64 positions)


def test_kv_bytes_per_token_is_what_the_caches_hold(tiny_target):
    verifier, drafter = make_engines(tiny_target)
    # tiny Llama: 2 (K, V) x 4 layers x 2 KV heads x head dim 8 x 4 B; its drafter: 1 layer
    assert verifier.sessions.bytes_per_token == 2 * 4 * 2 * 8 * 4 == PER
    pre = verifier.prefill("s", PROMPT)
    res = verifier.verify("s", pre.base, TokenTree.from_lists([pre.anchor, 1, 2, 3], [-1, 0, 1, 0]))
    s = verifier.sessions["s"]
    assert _committed_bytes(s.kv) == s.positions * verifier.sessions.bytes_per_token == res.base * PER
    # what is counted is what the store holds: the session's whole slot, not its 8 positions
    assert verifier.info().memory.in_use_bytes == verifier.kv_store.nbytes == s.kv.nbytes
    assert s.kv.nbytes == verifier.kv_store.min_capacity * PER
    drafter.prefill("s", pre.delta)
    drafter.commit("s", res.delta)
    d = drafter.sessions["s"]
    assert _committed_bytes(d.kv) == d.positions * drafter.sessions.bytes_per_token
    assert drafter.info().memory.in_use_bytes == d.kv.nbytes >= _committed_bytes(d.kv)
    assert drafter.sessions.bytes_per_token == 2 * 1 * 2 * 8 * 4


def test_a_call_over_the_kv_budget_is_refused_before_it_allocates(tiny_target):
    verifier = CountingVerifier(tiny_target, (0, 2), max_kv_bytes=100 * PER, kv_min_capacity=64)
    a = verifier.prefill("a", [1 + i % 15 for i in range(60)])  # one slot of 64: 64 of the 100
    before = verifier.forwards
    assert before == 1  # the prefill's one forward: the count sees the target's forwards
    with pytest.raises(LimitExceededError, match="budget"):
        verifier.prefill("b", [1] * 50)  # a second slot of 64: the page doubles, 128 > 100
    tree = TokenTree.from_lists([a.anchor] + [1] * 44, [-1] + [0] * 44)  # 60 + 45 > 64: a slot of 128
    with pytest.raises(LimitExceededError, match="budget"):
        verifier.verify("a", a.base, tree)
    with pytest.raises(LimitExceededError, match="budget"):
        verifier.prefill("a", [1] * 50, restart=True)  # the old session is held until replaced
    assert verifier.forwards == before and list(verifier.sessions) == ["a"]
    assert verifier.sessions.in_use_bytes() == verifier.kv_store.nbytes == SLOT
    # "a" goes on as if the refused calls never happened, inside its slot
    ar = hf_greedy(tiny_target, [1 + i % 15 for i in range(60)], 5)
    out, base = [a.anchor], a.base
    while len(out) < 5:
        res = verifier.step("a", base, out[-1])
        out.append(res.bonus)
        base = res.base
    assert out == ar and verifier.kv_store.nbytes == SLOT
    verifier.close("a")
    assert verifier.kv_store.nbytes == 0  # its page is freed with its last slot
    verifier.prefill("b", [1] * 50)  # room again

    _, drafter = make_engines(tiny_target)
    per = drafter.sessions.bytes_per_token
    drafter.sessions.budget_bytes = 100 * per
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    assert drafter.prefill("d", FeatureDelta(0, tuple(range(1, 9)), torch.zeros(8, width))) == 8
    assert drafter.sessions.in_use_bytes() == 64 * per  # 8 positions, a buffer of 64 (1.5x, whole key blocks)
    with pytest.raises(LimitExceededError, match="budget"):  # 68 > 64: a buffer of 128 beside the 64
        drafter.commit("d", FeatureDelta(8, (1,) * 60, torch.zeros(60, width)))
    with pytest.raises(LimitExceededError, match="budget"):
        drafter.prefill("e", FeatureDelta(0, (1, 2, 3), torch.zeros(3, width)))
    assert drafter.sessions["d"].base == 8 and list(drafter.sessions) == ["d"]
    assert drafter.commit("d", FeatureDelta(8, (1, 2), torch.zeros(2, width))) == 10


def test_a_batch_call_over_the_budget_is_refused_in_its_slot_and_the_others_go_on(tiny_target):
    budgeted = HFVerifier(tiny_target, (0, 2), max_kv_bytes=3 * SLOT, kv_min_capacity=64)
    free = HFVerifier(tiny_target, (0, 2))
    prompts = {"x": [1 + i % 15 for i in range(30)], "y": [2 + i % 13 for i in range(30)]}
    calls = []
    for sid, prompt in prompts.items():
        assert budgeted.prefill(sid, prompt).anchor == free.prefill(sid, prompt).anchor
        s = free.sessions[sid]
        n = 4 if sid == "x" else 39  # two slots of 64 held: 35 fits x's, 70 needs a slot of 128
        greedy = hf_greedy(tiny_target, s.tokens, n)
        tree = TokenTree.from_lists([s.tokens[-1], *greedy], list(range(-1, n)))
        calls.append(VerifyCall(sid, s.base, tree))
    assert budgeted.kv_store.nbytes == 2 * SLOT
    got = budgeted.verify_batch(calls)
    assert isinstance(got[1], LimitExceededError) and "budget" in str(got[1])
    want = free.verify(calls[0].session_id, calls[0].base, calls[0].tree)
    assert got[0].new_tokens == want.new_tokens
    assert torch.allclose(got[0].delta.features, want.delta.features, atol=1e-5)
    assert budgeted.sessions["y"].base == free.sessions["y"].base  # the refused one: untouched
    assert budgeted.kv_store.nbytes == 2 * SLOT


def test_a_batch_admits_each_call_after_the_others_of_the_batch(tiny_target):
    """Two trees that each fit the budget alone but not together: the second is refused,
    though neither was allocated when it was admitted."""
    verifier = HFVerifier(tiny_target, (0, 2), max_kv_bytes=2 * SLOT + 128 * PER + 64 * PER,
                          kv_min_capacity=64)
    calls = []
    for sid in ("x", "y"):
        pre = verifier.prefill(sid, [1 + i % 15 for i in range(40)])
        tree = TokenTree.from_lists([pre.anchor] + [1] * 30, list(range(-1, 30)))
        calls.append(VerifyCall(sid, pre.base, tree))
    got = verifier.verify_batch(calls)  # each moves to a slot of 128: a page of 1, then it doubles
    assert not isinstance(got[0], Exception) and isinstance(got[1], LimitExceededError), got
    assert verifier.kv_store.nbytes <= verifier.sessions.budget_bytes


def test_kv_held_stays_inside_the_budget_through_a_churn_of_short_sessions(tiny_target):
    """Many short sessions open, step, grow and close: the bytes the store holds never pass
    the budget, and every page is freed once its sessions are gone."""
    import random

    budget = 6 * SLOT
    verifier = HFVerifier(tiny_target, (0, 2), max_kv_bytes=budget, kv_min_capacity=64)
    rng = random.Random(0)
    open_ids: list[str] = []
    refused = 0
    for i in range(120):
        try:
            if open_ids and rng.random() < 0.45:
                sid = open_ids.pop(rng.randrange(len(open_ids)))
                verifier.close(sid)
            elif open_ids and rng.random() < 0.5:
                sid = rng.choice(open_ids)
                s = verifier.sessions[sid]
                n = rng.choice((1, 8, 40))
                verifier.verify(sid, s.base, TokenTree.from_lists([s.tokens[-1]] + [1] * (n - 1),
                                                                   list(range(-1, n - 1))))
            else:
                sid = f"s{i}"
                verifier.prefill(sid, [1 + j % 15 for j in range(rng.randint(5, 70))])
                open_ids.append(sid)
        except LimitExceededError:
            refused += 1
        assert verifier.kv_store.nbytes <= budget, i
        assert verifier.info().memory.in_use_bytes == verifier.kv_store.nbytes
    assert refused > 0  # the budget was reached: the bound was tested, not just never approached
    del s  # the test's own reference to a session (its slot lives as long as it does)
    for sid in open_ids:
        verifier.close(sid)
    assert verifier.kv_store.nbytes == 0 and not verifier.kv_store.pages  # no collection needed


def test_the_kv_budget_over_grpc_and_in_info(tiny_target):
    verifier = HFVerifier(tiny_target, (0, 2), max_kv_bytes=100 * PER, kv_min_capacity=64)
    server = LocalServer("verifier").start(verifier)
    remote = RemoteVerifier(server.address)
    try:
        remote.prefill("a", [1] * 12)
        with pytest.raises(LimitExceededError, match="budget"):
            remote.prefill("b", [1] * 12)
        memory = remote.info(fresh=True).memory
        assert (memory.budget_bytes, memory.in_use_bytes, memory.bytes_per_token) == (100 * PER, SLOT, PER)
    finally:
        remote.shutdown()
        server.stop()


def test_the_default_budget_is_a_share_of_free_memory():
    budget = kv_budget(torch.device("cpu"), None)
    free, _ = free_memory(torch.device("cpu"))
    assert 0 < budget.nbytes <= KV_SHARE * free * 1.05 and "MemAvailable" in budget.rule
    assert kv_budget(torch.device("cpu"), 2.5).nbytes == 2_500_000_000


# -- chunked prefill: the same result, and other sessions' calls run between chunks -------
def test_a_chunked_prefill_equals_an_unchunked_one_and_stays_lossless(tiny_target):
    prompt = [1 + (7 * i) % 15 for i in range(37)]
    whole, chunked = make_engines(tiny_target), make_engines(tiny_target)
    chunked[0].prefill_chunk = 4
    a, b = whole[0].prefill("s", prompt), chunked[0].prefill("s", prompt)
    assert a.anchor == b.anchor and a.base == b.base
    assert torch.allclose(a.delta.features, b.delta.features, atol=1e-5)
    ka, kb = whole[0].sessions["s"].kv, chunked[0].sessions["s"].kv
    for layer in range(len(ka.keys)):
        for x, y in zip(ka.committed(layer), kb.committed(layer)):
            assert torch.allclose(x, y, atol=1e-5)
    params = GenerationParams("presto-beam", TreeParams(budget=8), max_new_tokens=24)
    res = generate(*chunked, prompt, params)
    assert res.token_ids == hf_greedy(tiny_target, prompt, 24) == generate(*whole, prompt, params).token_ids


def test_another_sessions_step_runs_between_the_chunks_of_a_long_prefill(tiny_target):
    engine = CountingVerifier(tiny_target, (0, 2), prefill_chunk=8, delay_s=0.05)
    server = LocalServer("verifier").start(engine)
    remote, other = RemoteVerifier(server.address), RemoteVerifier(server.address)
    try:
        short = other.prefill("short", [1, 2, 3])
        long_prompt = [1 + i % 15 for i in range(160)]  # 20 chunks of 8, 50 ms each
        engine.events.clear()
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(remote.prefill, "long", long_prompt)
            while not engine.events:
                time.sleep(0.01)
            step = other.step("short", short.base, short.anchor)
            assert not long.done()  # the step did not wait for the whole prefill
            pre = long.result(timeout=60)
        kinds = [k for k, _ in engine.events]
        assert kinds.count("chunk") == 20 and "step" in kinds[1:-1]
        assert step.bonus == hf_greedy(tiny_target, [1, 2, 3], 2)[1]
        assert pre.anchor == hf_greedy(tiny_target, long_prompt, 1)[0]
        # a prefill stopped between chunks (its deadline) leaves no session and no reservation behind
        remote.prefill_timeout_s = 0.3
        started = len(engine.events)
        with pytest.raises(VerifierUnavailableError, match="DEADLINE_EXCEEDED"):
            remote.prefill("late", long_prompt)
        assert len(engine.events) > started  # it ran chunks, so it was seated
        # the server stops the late prefill at its next chunk boundary: wait for that event
        # (its seat released), not for a fixed time a loaded machine may overrun
        deadline = time.monotonic() + 30
        while engine._seated and time.monotonic() < deadline:
            time.sleep(0.02)
        assert set(engine.sessions) == {"anonymous/short", "anonymous/long"}
        # what is held is the store's pages (the late prompt's slot is free again, its page's
        # slack stays until the page empties), and no seat is left reserving bytes
        assert engine.sessions.in_use_bytes() == engine.kv_store.nbytes and not engine._seated
        assert sum(len(p._used) for pages in engine.kv_store.pages.values() for p in pages) == 2
    finally:
        remote.shutdown()
        other.shutdown()
        server.stop()


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_a_long_prompt_chunked_equals_ar():
    """The real target in fp32, a prompt of three chunks: the loop's greedy output is
    transformers' own, with and without chunking."""
    from presto_sd.app.generate import encode_prompt
    from presto_sd.embedded.stack import build_embedded

    stack = build_embedded(device=torch.device("cpu"), dtype=torch.float32)
    colors = ["red", "green", "blue", "amber", "violet", "white", "black"]
    text = " ".join(f"Box {i} is {colors[i % 7]} and holds {3 * i + 1} apples." for i in range(100))
    prompt = encode_prompt(stack.tokenizer, text + " Which box holds the most apples?", chat=True)
    assert 1024 < len(prompt) < 1536  # three chunks of 512
    with torch.no_grad():
        ref = stack.verifier.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    ref = ref[0, len(prompt):].tolist()
    params = GenerationParams("presto-beam", TreeParams(budget=16), max_new_tokens=24,
                              stop_token_ids=stack.verifier.eos_token_ids)
    for chunk in (512, 4096):
        stack.verifier.prefill_chunk = chunk
        assert generate(stack.verifier, stack.drafter, prompt, params).token_ids == ref, chunk
