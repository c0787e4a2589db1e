"""Batched verification: several sessions' trees in one forward equal verifying them one by one."""

from __future__ import annotations

import functools

import pytest
import torch

from presto_sd.embedded import hf_verifier as hf
from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.embedded.packing import ForwardCost, plan_batches
from presto_sd.engine.messages import (
    InvalidArgumentError,
    LimitExceededError,
    SessionNotFoundError,
    StaleBaseError,
    VerifierUnavailableError,
    session_tag,
)
from presto_sd.engine.verifier import VerifierLimits, VerifyCall, VerifyResult
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.builders import TreeParams
from presto_sd.method.tree import TokenTree, TreeBatch, TreeLimits, tree_attention_mask
from tests.conftest import hf_greedy, make_engines
from tests.rpc_util import LocalServer
from verifier_service.remote import RemoteVerifier

LAYOUTS = ["packed", "padded", "auto"]
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


# -- the layout, without a model ----------------------------------------------------------
@pytest.mark.parametrize("make", [TreeBatch.packed, TreeBatch.padded])
def test_each_node_sees_its_own_prefix_and_ancestors(make):
    trees, bases = small_trees(), [3, 6, 2]
    batch = make(trees, bases)
    mask = batch.attention_mask()
    rows, p, q_len = len(batch.rows), batch.prefix_len, batch.query_len
    assert mask.shape == (rows, 1, q_len, p + q_len) and mask.dtype == torch.float32
    allowed = mask[:, 0] == 0
    expected = torch.zeros_like(allowed)
    expected[:, :, p:] = torch.eye(q_len, dtype=torch.bool)  # padding queries: themselves only
    ids, pos = batch.input_ids(), batch.position_ids()
    for i, (tree, base) in enumerate(zip(trees, bases)):
        r, k, q = batch.slot(i)
        n = len(tree.tokens)
        # per tree, exactly the single-tree mask: its prefix, then its ancestors
        own = tree_attention_mask(tree, base)[0, 0] == 0
        expected[r, q : q + n] = False
        expected[r, q : q + n, k : k + base] = own[:, :base]
        expected[r, q : q + n, p + q : p + q + n] = own[:, base:]
        assert ids[r, q : q + n].tolist() == list(tree.tokens)
        assert pos[r, q : q + n].tolist() == [base + d for d in tree.depths]
    assert torch.equal(allowed, expected)


def test_packed_and_padded_shapes():
    trees, bases = small_trees(), [3, 6, 2]
    packed, padded = TreeBatch.packed(trees, bases), TreeBatch.padded(trees, bases)
    assert (len(packed.rows), packed.prefix_len, packed.query_len) == (1, 11, 9)
    assert (len(padded.rows), padded.prefix_len, padded.query_len) == (3, 6, 5)
    assert [packed.slot(i) for i in range(3)] == [(0, 0, 0), (0, 3, 3), (0, 9, 4)]
    assert [padded.slot(i) for i in range(3)] == [(0, 3, 0), (1, 0, 0), (2, 4, 0)]  # left-padded prefixes


def test_bf16_mask_uses_its_own_minimum():
    mask = TreeBatch.padded(small_trees(), [1, 2, 3]).attention_mask(torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask.min() == torch.finfo(torch.bfloat16).min


def test_rows_must_split_the_trees():
    trees = small_trees()[:2]
    for rows in [((0,),), ((0, 1), (1,)), ((0,), ()), ((0, 2), (1,))]:
        with pytest.raises(ValueError, match="rows"):
            TreeBatch(tuple(trees), (1, 1), rows)
    with pytest.raises(ValueError, match="bases"):
        TreeBatch(tuple(trees), (1,), ((0, 1),))


SMOLLM2 = ForwardCost(per_token=2 * 3.54e6 * 30, per_pair=4 * 576 * 30)  # its decoder's FLOPs


def test_the_flop_count_picks_the_layout_measured_faster():
    """SmolLM2 on one CPU thread (docs/services.md): equal trees ran faster padded,
    trees of very different sizes packed."""
    def pick(sizes, contexts):
        trees = [TokenTree.from_lists([1] * n, chain(n)) for n in sizes]
        return plan_batches(trees, contexts, SMOLLM2)[0][1]

    assert len(pick([17] * 4, [200] * 4).rows) == 4
    assert len(pick([17] * 8, [200] * 8).rows) == 8
    assert len(pick([5, 9, 17, 65], [200] * 4).rows) == 1


def test_a_batch_over_the_mask_cap_is_split_in_order():
    trees = [TokenTree.from_lists([1] * 8, chain(8)) for _ in range(5)]
    plan = plan_batches(trees, [100] * 5, SMOLLM2, "padded", max_mask_elements=2 * 8 * 108)
    assert [group for group, _ in plan] == [[0, 1], [2, 3], [4]]
    assert plan_batches(trees, [100] * 5, SMOLLM2, "packed", max_mask_elements=1)[0][0] == [0]


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


def open_twice(target, prompts, layout="auto", sampling=None):
    """The same sessions on a batching verifier and on a reference one."""
    batched, ref = HFVerifier(target, (0, 2), batch_layout=layout), HFVerifier(target, (0, 2))
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
    for la, lb in zip(sa.cache.layers, sb.cache.layers):
        torch.testing.assert_close(la.keys, lb.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(la.values, lb.values, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_equals_one_by_one(tiny_target, layout):
    """Different contexts (3..20) and tree sizes (1..17 nodes), three rounds."""
    batched, ref = open_twice(tiny_target, PROMPTS, layout)
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
        trees = [drafter.draft(sid, anchors[sid], bases[sid], params[sid]).tree for sid in live]
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
    params = {f"g{i}": TreeParams(method=m, budget=4 + 6 * i, depth=6) for i, m in enumerate(methods)}
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


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_sampling_with_seeds_equals_one_by_one(tiny_target, layout):
    sampling = [SamplingParams(temperature=t, top_k=k, seed=s)
                for t, k, s in [(1.0, 0, 1), (0.7, 8, 2), (1.3, 0, 3)]]
    batched, ref = open_twice(tiny_target, PROMPTS[:3], layout, sampling)
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
        assert batched.sessions[sid].cache.layers[0].keys.shape[-2] == s[sid].base
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
    batched, ref = open_twice(tiny_target, PROMPTS[:3], "packed", sampling)
    calls = [VerifyCall(sid, s.base, sampling_tree(s.tokens[-1])) for sid, s in batched.sessions.items()]
    before = {sid: (list(s.tokens), s.generator.get_state()) for sid, s in batched.sessions.items()}
    owner, name = {"forward": (HFVerifier, "_forward_rows"), "walk": (hf, "walk_tree"),
                   "commit": (hf, "append_kv")}[stage]
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
        assert s.cache.layers[0].keys.shape[-2] == s.base == len(before[sid][0]) - 1
        assert s.tokens == before[sid][0] and torch.equal(s.generator.get_state(), before[sid][1])
    # as if the failed call never happened: the same draws as the reference
    for c, res in zip(calls, batched.verify_batch(calls)):
        assert_same(res, ref.verify(c.session_id, c.base, c.tree))
        assert_same_caches(batched, ref, c.session_id)


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
        server.stop()
        down = remote.verify_batch(calls[:2])  # the whole call failed: every item's error
        assert len(down) == 2 and all(isinstance(e, VerifierUnavailableError) for e in down)
    finally:
        remote.shutdown()
        server.stop()
