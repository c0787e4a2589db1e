"""Batched verification: several sessions' trees in one forward equal verifying them one by one."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from drafter_service.remote import RemoteDrafter
from presto_sd.embedded import hf_verifier as hf
from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.embedded.target_runner import TargetRunner
from presto_sd.engine.drafter import DraftCall
from presto_sd.engine.messages import (
    AlreadyExistsError,
    DrafterUnavailableError,
    InvalidArgumentError,
    LimitExceededError,
    SessionNotFoundError,
    StaleBaseError,
    VerifierUnavailableError,
    session_tag,
)
from presto_sd.engine.verifier import PrefillCall, PrefillResult, VerifierLimits, VerifyCall, VerifyResult
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.builders import TreeParams
from presto_sd.method.tree import TokenTree, TreeLimits
from presto_sd.models import packed
from presto_sd.models.packed import Segment, packed_forward
from presto_sd.models.session_kv import KVStore, SessionKV
from tests.conftest import hf_greedy, make_engines
from tests.rpc_util import LocalServer
from verifier_service.remote import RemoteVerifier

PROMPTS = [[0, 3, 5], [0, 1, 1, 2, 3, 5, 8, 13], [4] * 20, [0, 9, 2, 7, 7, 1]]
ATOL = 1e-5


def chain(n: int) -> list[int]:
    return [-1] + list(range(n - 1))


def small_trees() -> list[TokenTree]:
    return [
        TokenTree.from_lists([1, 2, 3], [-1, 0, 0]),
        TokenTree.from_lists([4], [-1]),
        TokenTree.from_lists([5, 6, 7, 8, 9], [-1, 0, 1, 1, 0]),
    ]


# -- one session's buffers, without a model -------------------------------------------
def test_session_kv_grows_keeps_a_path_and_truncates():
    kv = SessionKV(layers=2, kv_heads=1, head_dim=2, dtype=torch.float32)
    entries = torch.arange(10.0).repeat_interleave(2).view(1, 1, 10, 2)
    kv.reserve(3)
    kv.write(0, entries[:, :, :3], -entries[:, :, :3])
    kv.keep([0, 1, 2])
    cap = kv.capacity
    kv.reserve(cap + 1)  # doubling keeps what is committed
    assert kv.capacity == 2 * cap and torch.equal(kv.committed(0)[0], entries[:, :, :3])
    k, v = kv.write(0, entries[:, :, 3:8], -entries[:, :, 3:8])  # a tree's five nodes
    assert k.shape[2] == 8 and kv.length == 3  # written after the committed, not committed
    kv.keep([0, 2, 4])  # an accepted path off the node order, moved down in place
    keys, values = kv.committed(0)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5, 7] and torch.equal(values, -keys)
    kv.truncate(4)
    assert kv.length == 4 and kv.nbytes == 2 * 2 * kv.capacity * 2 * 4
    assert SessionKV.bytes_per_token(30, 3, 64, torch.bfloat16) == 2 * 30 * 3 * 64 * 2


def test_a_lone_session_computes_a_cached_forward(tiny_target):
    """In place, a prompt chunk is transformers' own sdpa over the same keys (bitwise); an AR
    step attends one row at a time (``row_attention``) with row-invariant linears: the same
    math, rounded its own way."""
    decoder, prompt = tiny_target.get_decoder(), list(range(1, 14))
    with torch.no_grad():
        ref = DynamicCache()
        ids = torch.tensor([prompt])
        want = [decoder(input_ids=ids, cache=ref, use_cache=True).last_hidden_state]
        kv = SessionKV.for_model(tiny_target)
        with packed_forward(tiny_target, [Segment(kv, 0, len(prompt))]):
            got = [decoder(input_ids=ids, use_cache=False).last_hidden_state]
        kv.keep(range(len(prompt)))
        for t in (3, 1, 4):
            pos = torch.tensor([[kv.length]])
            want.append(decoder(input_ids=torch.tensor([[t]]), position_ids=pos, cache=ref,
                                use_cache=True).last_hidden_state)
            with packed_forward(tiny_target, [Segment(kv, 0, 1)]):
                out = decoder(input_ids=torch.tensor([[t]]), position_ids=pos, use_cache=False)
            got.append(out.last_hidden_state)
            kv.keep([0])
    assert torch.equal(want[0], got[0])
    for w, g in zip(want[1:], got[1:]):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    for layer, theirs in enumerate(ref.layers):
        torch.testing.assert_close(kv.committed(layer)[0], theirs.keys, atol=ATOL, rtol=0)
    assert tiny_target.config._attn_implementation != "presto_sessions"  # restored after each forward


def test_store_slots_grow_move_between_classes_and_come_back():
    store = KVStore(layers=2, kv_heads=1, head_dim=2, dtype=torch.float32, page_slots=2, min_capacity=4)
    a, b, c = store.session(), store.session(), store.session()
    for kv, n in ((a, 3), (b, 4), (c, 2)):
        kv.reserve(n)
    assert [(kv.capacity, kv.slot) for kv in (a, b, c)] == [(4, 0), (4, 1), (4, 0)]
    assert a.page is b.page and c.page is not a.page and a.page.slots == 2  # a full page: a new one
    entries = torch.arange(3.0).view(1, 1, 3, 1).expand(1, 1, 3, 2)
    a.append([(entries, -entries)] * 2)
    a.reserve(5)  # outgrows its class: moves to a slot of the next, with what it committed
    assert (a.capacity, a.slot) == (8, 0) and torch.equal(a.committed(1)[0], entries)
    d = store.session()
    d.reserve(1)
    assert (d.page, d.slot) == (b.page, 0)  # a's old slot came back
    del b
    e = store.session()
    e.reserve(4)
    assert (e.page, e.slot) == (d.page, 1)  # so did b's, when it was dropped


def test_a_slot_comes_back_from_a_finalizer_that_runs_inside_take():
    """A garbage collection inside ``KVPage.take`` (it allocates) may drop a session, whose
    finalizer gives its slot back on the same thread while ``take`` holds the page's lock:
    that must not deadlock (it hung a verifier once)."""
    import threading

    store = KVStore(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, page_slots=4, min_capacity=4)
    kv = store.session()
    kv.reserve(2)
    page, slot = kv.page, kv.slot

    def reenter() -> None:
        with page._lock:  # what ``take`` holds when the collector runs the finalizer
            page.give(slot)

    t = threading.Thread(target=reenter, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "give() deadlocked inside take()'s lock"
    assert page.take() == slot


@pytest.mark.parametrize("min_capacity", [8, 64])
def test_ar_steps_of_many_sessions_attend_in_one_call(tiny_target, monkeypatch, min_capacity):
    """AR rows of sessions on a shared page attend in one call per page and key width, equal
    to one-by-one; sessions cross capacity classes (moving slots) as they grow. Slots
    narrower than a key block (capacity 8-32) gather their keys instead, still equal."""
    batched, ref = HFVerifier(tiny_target, (0, 2)), HFVerifier(tiny_target, (0, 2))
    batched.kv_store = KVStore.for_model(tiny_target, page_slots=4, min_capacity=min_capacity)
    long = [1 + i % 15 for i in range(min_capacity - 3)]  # crosses into the next class
    prompts = [*PROMPTS, long]  # five sessions: a page of four, and one alone
    for i, prompt in enumerate(prompts):
        assert batched.prefill(f"s{i}", prompt).anchor == ref.prefill(f"s{i}", prompt).anchor
    rows_of_steps, rows_gathered = [], []  # per group call: AR steps read from their slots, or gathered
    real = packed._group_attention
    monkeypatch.setattr(packed, "_group_attention", lambda *a, **k: (
        rows_of_steps if a[1].positions is None else rows_gathered).append(len(a[1].rows)) or real(*a, **k))
    for _ in range(6):
        calls = [VerifyCall(sid, s.base, TokenTree.root_only(s.tokens[-1]))
                 for sid, s in ref.sessions.items()]
        for c, res in zip(calls, batched.verify_batch(calls)):
            assert_same(res, ref.verify(c.session_id, c.base, c.tree))
    for sid in ref.sessions:
        assert_same_caches(batched, ref, sid)
    capacities = {kv.capacity for kv in (s.kv for s in batched.sessions.values())}
    if min_capacity == 8:
        assert capacities >= {16, 32} and rows_gathered and max(rows_of_steps) == 1
    else:
        layers = tiny_target.config.num_hidden_layers
        assert len(rows_of_steps) >= 6 * layers and max(rows_of_steps) >= 3
        assert capacities == {64, 128}


# -- against per-request verification on the tiny target ----------------------------------
def oracle_tree(anchor: int, truth: list[int], g: torch.Generator, vocab: int = 16) -> TokenTree:
    """The target's own continuation among decoys at shuffled node indices, so acceptance
    runs deep and off the node order; ``truth`` may be cut short by the caller."""
    tokens, parents, parent = [anchor], [-1], 0
    for t in truth:
        decoy = (t + 1 + int(torch.randint(0, vocab - 1, (1,), generator=g))) % vocab
        first = int(torch.randint(0, 2, (1,), generator=g))
        at = len(tokens)
        tokens += [decoy, t] if first else [t, decoy]
        parents += [parent, parent]
        parent = at + first
    return TokenTree.from_lists(tokens, parents)


def open_twice(target, prompts, sampling=None):
    """The same sessions on a batching verifier and on a reference one."""
    batched, ref = HFVerifier(target, (0, 2)), HFVerifier(target, (0, 2))
    for i, prompt in enumerate(prompts):
        s = sampling[i] if sampling else SamplingParams()
        assert batched.prefill(f"s{i}", prompt, s).anchor == ref.prefill(f"s{i}", prompt, s).anchor
    return batched, ref


def assert_same(res: VerifyResult, want: VerifyResult) -> None:
    assert (res.accepted, res.bonus, res.base, res.accepted_nodes) == (
        want.accepted, want.bonus, want.base, want.accepted_nodes)
    assert (res.delta.start, res.delta.tokens) == (want.delta.start, want.delta.tokens)
    torch.testing.assert_close(res.delta.features, want.delta.features, atol=ATOL, rtol=0)
    if want.node_probs is not None:
        torch.testing.assert_close(res.node_probs, want.node_probs, atol=ATOL, rtol=0)


def assert_same_caches(a: HFVerifier, b: HFVerifier, sid: str) -> None:
    sa, sb = a.sessions[sid], b.sessions[sid]
    assert sa.tokens == sb.tokens
    for layer in range(len(sa.kv.keys)):
        for a_kv, b_kv in zip(sa.kv.committed(layer), sb.kv.committed(layer)):
            torch.testing.assert_close(a_kv, b_kv, atol=ATOL, rtol=0)


def test_batch_equals_one_by_one(tiny_target):
    """Different contexts (3..20) and tree sizes (1..17 nodes: AR rows among tree rows), three rounds."""
    batched, ref = open_twice(tiny_target, PROMPTS)
    g = torch.Generator().manual_seed(0)
    for rnd in range(3):
        calls = []
        for i in range(len(PROMPTS)):
            s = ref.sessions[f"s{i}"]
            truth = hf_greedy(tiny_target, s.tokens, 8)
            keep = [0, 1, 4, 8][(i + rnd) % 4]  # root-only .. 17 nodes
            calls.append(VerifyCall(f"s{i}", s.base, oracle_tree(s.tokens[-1], truth[:keep], g),
                                    want_node_probs=i == 1))
        got = batched.verify_batch(calls)
        for c, res in zip(calls, got):
            assert_same(res, ref.verify(c.session_id, c.base, c.tree, c.want_node_probs))
            assert_same_caches(batched, ref, c.session_id)
        assert sum(len(r.accepted) for r in got) >= 4  # real multi-token acceptance


def draft_and_verify_rounds(verifier, drafter, prompts, params, n):
    """Several concurrent greedy generations, every round's trees in one verify_batch."""
    out, bases, anchors = {}, {}, {}
    for i, prompt in enumerate(prompts):
        sid = f"g{i}"
        pre = verifier.prefill(sid, prompt)
        drafter.prefill(sid, pre.delta)
        out[sid], bases[sid], anchors[sid] = [pre.anchor], pre.base, pre.anchor
    while any(len(toks) < n for toks in out.values()):
        live = [sid for sid in out if len(out[sid]) < n]
        trees = [drafter.draft(sid, anchors[sid], bases[sid], *params[sid]).tree for sid in live]
        results = verifier.verify_batch([VerifyCall(sid, bases[sid], t) for sid, t in zip(live, trees)])
        for sid, res in zip(live, results):
            assert isinstance(res, VerifyResult), res
            drafter.commit(sid, res.delta)
            out[sid] += res.new_tokens
            bases[sid], anchors[sid] = res.base, res.bonus
    return {sid: toks[:n] for sid, toks in out.items()}


def test_greedy_generation_through_verify_batch_equals_ar(tiny_target):
    verifier, drafter = make_engines(tiny_target)
    methods = ["linear", "marginal", "presto-beam", "marginal"]
    params = {f"g{i}": (m, TreeParams(budget=4 + 6 * i, depth=6)) for i, m in enumerate(methods)}
    got = draft_and_verify_rounds(verifier, drafter, PROMPTS, params, 24)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"g{i}"] == hf_greedy(tiny_target, prompt, 24), i


def sampling_tree(anchor: int) -> TokenTree:
    """Every token under the root and two under each: sampled walks often go deep."""
    tokens, parents = [anchor, *range(16)], [-1] + [0] * 16
    for child in range(1, 17):
        tokens += [(child * 5) % 16, (child * 5 + 1) % 16]
        parents += [child, child]
    return TokenTree.from_lists(tokens, parents)


def test_sampling_with_seeds_equals_one_by_one(tiny_target):
    sampling = [SamplingParams(temperature=t, top_k=k, seed=s)
                for t, k, s in [(1.0, 0, 1), (0.7, 8, 2), (1.3, 0, 3)]]
    batched, ref = open_twice(tiny_target, PROMPTS[:3], sampling)
    accepted = 0
    for _ in range(6):
        calls = [VerifyCall(sid, s.base, sampling_tree(s.tokens[-1])) for sid, s in ref.sessions.items()]
        for c, res in zip(calls, batched.verify_batch(calls)):
            assert_same(res, ref.verify(c.session_id, c.base, c.tree))
            accepted += len(res.accepted)
    assert accepted >= 6


def test_bad_calls_get_their_own_errors_and_the_others_go_on(tiny_target):
    batched, ref = open_twice(tiny_target, PROMPTS)
    s, g = ref.sessions, torch.Generator().manual_seed(1)

    def tree(sid, n=4):
        return oracle_tree(s[sid].tokens[-1], hf_greedy(tiny_target, s[sid].tokens, n), g)

    calls = [
        VerifyCall("s0", s["s0"].base, tree("s0")),
        VerifyCall("s1", s["s1"].base + 1, tree("s1")),  # stale base
        VerifyCall("nope", 3, tree("s0")),  # unknown session
        VerifyCall("s2", s["s2"].base, TokenTree.from_lists([s["s2"].tokens[-1], 1, 2], [-1, 2, 0])),
        VerifyCall("s0", s["s0"].base, tree("s0")),  # the same session again
        VerifyCall("s3", s["s3"].base, tree("s3", 1)),
    ]
    got = batched.verify_batch(calls)
    assert isinstance(got[1], StaleBaseError) and "stale base" in str(got[1])
    assert isinstance(got[2], SessionNotFoundError)
    assert isinstance(got[3], InvalidArgumentError) and "tree.parents[1]" in str(got[3])
    assert isinstance(got[4], InvalidArgumentError) and "already in this batch" in str(got[4])
    for j in (0, 5):
        assert_same(got[j], ref.verify(calls[j].session_id, calls[j].base, calls[j].tree))
    for sid in ("s1", "s2"):  # refused: untouched, and they go on as AR
        assert batched.sessions[sid].kv.length == s[sid].base
        r = batched.step(sid, s[sid].base, s[sid].tokens[-1])
        assert r.bonus == hf_greedy(tiny_target, PROMPTS[int(sid[1])], 2)[1]
    assert batched.verify_batch([]) == []


def test_over_a_limit_is_resource_exhausted_in_its_slot(tiny_target):
    v = HFVerifier(tiny_target, (0, 2), limits=VerifierLimits(tree=TreeLimits(max_nodes=4)))
    anchors = [v.prefill(f"s{i}", p).anchor for i, p in enumerate(PROMPTS[:2])]
    calls = [VerifyCall("s0", 3, TokenTree.from_lists([anchors[0]] + [1] * 5, chain(6))),
             VerifyCall("s1", 8, TokenTree.from_lists([anchors[1], 1, 2], [-1, 0, 0]))]
    got = v.verify_batch(calls)
    assert isinstance(got[0], LimitExceededError) and isinstance(got[1], VerifyResult)


@pytest.mark.parametrize("stage", ["forward", "walk", "commit"])
def test_a_failure_rolls_every_session_back(tiny_target, monkeypatch, stage):
    sampling = [SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    batched, ref = open_twice(tiny_target, PROMPTS[:3], sampling)
    calls = [VerifyCall(sid, s.base, sampling_tree(s.tokens[-1])) for sid, s in batched.sessions.items()]
    before = {sid: (list(s.tokens), s.generator.get_state()) for sid, s in batched.sessions.items()}
    owner, name = {"forward": (TargetRunner, "forward"), "walk": (hf, "walk_tree"),
                   "commit": (SessionKV, "keep")}[stage]
    real, seen = getattr(owner, name), []

    def fail_second(*args, **kwargs):  # the first goes through: one session walked or committed
        seen.append(1)
        out = real(*args, **kwargs)
        if len(seen) == 2 or stage == "forward":  # after the caches or generators moved
            raise RuntimeError(f"simulated failure in {stage}")
        return out

    monkeypatch.setattr(owner, name, fail_second)
    with pytest.raises(RuntimeError, match="simulated"):
        batched.verify_batch(calls)
    monkeypatch.undo()
    for sid, s in batched.sessions.items():
        assert s.kv.length == s.base == len(before[sid][0]) - 1
        assert s.tokens == before[sid][0] and torch.equal(s.generator.get_state(), before[sid][1])
    # as if the failed call never happened: the same draws as the reference
    for c, res in zip(calls, batched.verify_batch(calls)):
        assert_same(res, ref.verify(c.session_id, c.base, c.tree))
        assert_same_caches(batched, ref, c.session_id)


# -- new sessions' prompts in the same forward ---------------------------------------------
def assert_same_prefill(res: PrefillResult, want: PrefillResult) -> None:
    assert (res.anchor, res.base, res.delta.start, res.delta.tokens) == (
        want.anchor, want.base, want.delta.start, want.delta.tokens)
    torch.testing.assert_close(res.delta.features, want.delta.features, atol=ATOL, rtol=0)


def test_prompts_ride_in_the_batch_and_equal_prefill(tiny_target):
    """Prompts beside trees and AR steps of open sessions: the same anchors, features and KV
    as ``prefill`` alone (sampled anchors too), and the new sessions then decode as AR."""
    batched, ref = open_twice(tiny_target, PROMPTS[:2])
    g, s = torch.Generator().manual_seed(3), ref.sessions
    sampled = SamplingParams(temperature=1.0, seed=7)
    calls = [VerifyCall("s0", s["s0"].base, oracle_tree(s["s0"].tokens[-1], hf_greedy(
                 tiny_target, s["s0"].tokens, 3), g)),
             PrefillCall("n0", tuple(PROMPTS[2])),
             VerifyCall("s1", s["s1"].base, TokenTree.root_only(s["s1"].tokens[-1])),
             PrefillCall("n1", tuple(PROMPTS[3]), sampled)]
    got = batched.verify_batch(calls)
    assert_same(got[0], ref.verify("s0", calls[0].base, calls[0].tree))
    assert_same(got[2], ref.verify("s1", calls[2].base, calls[2].tree))
    assert_same_prefill(got[1], ref.prefill("n0", PROMPTS[2]))
    assert_same_prefill(got[3], ref.prefill("n1", PROMPTS[3], sampled))
    for sid in ("s0", "s1", "n0", "n1"):
        assert_same_caches(batched, ref, sid)
    for sid in ("n0", "n1"):  # a real session: AR goes on from it
        base, anchor = batched.sessions[sid].base, batched.sessions[sid].tokens[-1]
        assert batched.step(sid, base, anchor).bonus == ref.step(sid, base, anchor).bonus
    assert batched.sessions["n0"].tokens[len(PROMPTS[2]):] == hf_greedy(tiny_target, PROMPTS[2], 2)


def test_a_refused_prompt_opens_nothing_and_the_others_go_on(tiny_target):
    v = HFVerifier(tiny_target, (0, 2), limits=VerifierLimits(max_sessions=3))
    v.prefill("s0", PROMPTS[0])
    calls = [PrefillCall("s0", tuple(PROMPTS[1])),  # open, no restart
             PrefillCall("e", ()),  # empty
             PrefillCall("big", (1, 99_999)),  # out of the vocabulary
             PrefillCall("n0", tuple(PROMPTS[1])),
             PrefillCall("n0", tuple(PROMPTS[2])),  # the same session again
             PrefillCall("n1", tuple(PROMPTS[2])),
             PrefillCall("n2", tuple(PROMPTS[3]))]  # past the session cap (s0, n0, n1 hold it)
    got = v.verify_batch(calls)
    assert isinstance(got[0], AlreadyExistsError)
    assert isinstance(got[1], InvalidArgumentError) and "empty" in str(got[1])
    assert isinstance(got[2], InvalidArgumentError) and "out of range" in str(got[2])
    assert isinstance(got[4], InvalidArgumentError) and "already in this batch" in str(got[4])
    assert isinstance(got[6], LimitExceededError)
    assert isinstance(got[3], PrefillResult) and isinstance(got[5], PrefillResult)
    assert sorted(v.sessions) == ["n0", "n1", "s0"] and v.sessions["s0"].tokens[:-1] == PROMPTS[0]
    restart = v.verify_batch([PrefillCall("s0", tuple(PROMPTS[3]), restart=True)])[0]
    assert isinstance(restart, PrefillResult) and v.sessions["s0"].tokens[:-1] == PROMPTS[3]


def test_a_failed_forward_opens_no_prompt_and_frees_its_seat(tiny_target, monkeypatch):
    v = HFVerifier(tiny_target, (0, 2), limits=VerifierLimits(max_sessions=2))
    pre = v.prefill("s0", PROMPTS[0])
    calls = [VerifyCall("s0", pre.base, TokenTree.root_only(pre.anchor)),
             PrefillCall("n0", tuple(PROMPTS[1]))]
    monkeypatch.setattr(TargetRunner, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        v.verify_batch(calls)
    monkeypatch.undo()
    assert list(v.sessions) == ["s0"] and not v._seated  # no seat reserves bytes any more
    assert v.sessions.memory().in_use_bytes == v.kv_store.nbytes  # s0's slot and its page's slack
    assert [len(p._used) for pages in v.kv_store.pages.values() for p in pages] == [1]
    got = v.verify_batch(calls)  # the seat is free again
    assert isinstance(got[0], VerifyResult) and isinstance(got[1], PrefillResult)


# -- over gRPC ----------------------------------------------------------------------------
def test_verify_batch_over_grpc_equals_in_process(tiny_target):
    served, local = HFVerifier(tiny_target, (0, 2)), HFVerifier(tiny_target, (0, 2))
    server = LocalServer("verifier").start(served)
    remote = RemoteVerifier(server.address)
    try:
        for i, prompt in enumerate([*PROMPTS, [1, 2]]):
            assert remote.prefill(f"s{i}", prompt).anchor == local.prefill(f"s{i}", prompt).anchor
        g, s = torch.Generator().manual_seed(2), local.sessions
        for _ in range(2):
            calls = [VerifyCall(sid, s[sid].base, oracle_tree(s[sid].tokens[-1], hf_greedy(
                tiny_target, s[sid].tokens, 3), g), want_node_probs=sid == "s2")
                for sid in ("s0", "s1", "s2")]
            bad = [
                VerifyCall("s0", s["s0"].base, calls[0].tree),  # the same session again
                VerifyCall("nope", 1, calls[0].tree),
                VerifyCall("s3", s["s3"].base, TokenTree((1, 2), (-1,), (0,))),  # lengths differ
            ]
            got, want = remote.verify_batch(calls + bad), local.verify_batch(calls + bad)
            for res, ref in zip(got[:3], want):
                assert_same(res, ref)
            assert [type(e) for e in got[3:]] == [type(e) for e in want[3:]] == [
                InvalidArgumentError, SessionNotFoundError, InvalidArgumentError]
            # the same messages, but for the tag: over gRPC a session is keyed by its principal
            tags = {session_tag(f"anonymous/{sid}"): session_tag(sid) for sid in ("s0", "nope")}
            assert [functools.reduce(lambda t, kv: t.replace(*kv), tags.items(), str(e))
                    for e in got[3:]] == [str(e) for e in want[3:]]
        # prompts among the trees, in the caller's order; a refused one in its slot
        mixed = [PrefillCall("p0", tuple(PROMPTS[1])),
                 VerifyCall("s4", 2, TokenTree.root_only(s["s4"].tokens[-1])),
                 PrefillCall("s0", (1, 2)), PrefillCall("p1", tuple(PROMPTS[2]), SamplingParams(1.0, seed=3))]
        got, want = remote.verify_batch(mixed), local.verify_batch(mixed)
        assert_same_prefill(got[0], want[0])
        assert_same(got[1], want[1])
        assert isinstance(got[2], AlreadyExistsError) and isinstance(want[2], AlreadyExistsError)
        assert_same_prefill(got[3], want[3])
        server.stop()
        down = remote.verify_batch(calls[:2])  # the whole call failed: every item's error
        assert len(down) == 2 and all(isinstance(e, VerifierUnavailableError) for e in down)
    finally:
        remote.shutdown()
        server.stop()


# -- the drafter's side -------------------------------------------------------------------
def test_draft_batch_equals_one_by_one(tiny_target):
    """Blocks of sessions at different contexts in one drafter forward: the same trees."""
    verifier, drafter = make_engines(tiny_target)
    methods = ["linear", "marginal", "presto-beam", "presto-best-first"]
    calls = []
    for i, prompt in enumerate(PROMPTS):
        pre = verifier.prefill(f"d{i}", prompt)
        drafter.prefill(f"d{i}", pre.delta)
        calls.append(DraftCall(f"d{i}", pre.anchor, pre.base, methods[i],
                               TreeParams(budget=3 + 4 * i, depth=2 + i, top_k=4 + i)))
    bad = [replace(calls[0]),  # the same session again
           replace(calls[1], base=calls[1].base + 1),  # stale base
           replace(calls[0], session_id="nope", anchor=1, base=3)]
    got = drafter.draft_batch(calls + bad)
    for c, res in zip(calls, got):
        want = drafter.draft(c.session_id, c.anchor, c.base, c.method, c.params)
        assert res.tree == want.tree and res.path_scores == pytest.approx(want.path_scores, abs=1e-5)
        torch.testing.assert_close(res.marginals.log_probs, want.marginals.log_probs, atol=ATOL, rtol=0)
    assert isinstance(got[4], InvalidArgumentError) and "already in this batch" in str(got[4])
    assert [type(e) for e in drafter.draft_batch(bad[1:])] == [StaleBaseError, SessionNotFoundError]


def test_draft_batch_over_grpc_equals_in_process(tiny_target):
    verifier, served = make_engines(tiny_target)
    server = LocalServer("drafter").start(served)
    remote = RemoteDrafter(server.address)
    try:
        calls = []
        for i, prompt in enumerate(PROMPTS[:3]):
            pre = verifier.prefill(f"r{i}", prompt)
            remote.prefill(f"r{i}", pre.delta)
            params = TreeParams(budget=4 + i)
            calls.append(DraftCall(f"r{i}", pre.anchor, pre.base, "marginal", params))
        bad = [replace(calls[0], base=calls[0].base + 1),  # again, and stale
               replace(calls[0], session_id="nope", anchor=1, base=3)]
        got = remote.draft_batch(calls + bad)
        # the server keys sessions by principal (docs/services.md): the same calls in process
        want = served.draft_batch([replace(c, session_id=f"anonymous/{c.session_id}") for c in calls])
        assert [r.tree for r in got[:3]] == [r.tree for r in want]
        assert type(got[3]) is InvalidArgumentError and type(got[4]) is SessionNotFoundError
        server.stop()
        down = remote.draft_batch(calls[:2])  # the whole call failed: every item's error
        assert len(down) == 2 and all(isinstance(e, DrafterUnavailableError) for e in down)
    finally:
        remote.shutdown()
        server.stop()


def test_a_call_past_the_probed_rows_is_refused_in_its_slot(tiny_target, monkeypatch):
    """Rows past the call sizes whose kernels were probed row-invariant never share a
    forward: the call that would pass them is refused in its slot and the others run."""
    from presto_sd.embedded import hf_verifier

    monkeypatch.setattr(hf_verifier, "MAX_INVARIANT_ROWS", 8)
    v = HFVerifier(tiny_target, (0, 2))
    pre = {sid: v.prefill(sid, PROMPTS[0]) for sid in ("a", "b")}
    small = VerifyCall("a", pre["a"].base, TokenTree.root_only(pre["a"].anchor))
    wide = VerifyCall("b", pre["b"].base, TokenTree.from_lists([pre["b"].anchor] + [1] * 7, [-1] + [0] * 7))
    got = v.verify_batch([small, wide])  # 1 + 8 rows > 8
    assert isinstance(got[0], VerifyResult) and isinstance(got[1], LimitExceededError)
    assert "probed row-invariant" in str(got[1]) and v.sessions["b"].base == pre["b"].base
    alone = v.verify_batch([wide])  # a first call runs whatever its size
    assert isinstance(alone[0], VerifyResult)
