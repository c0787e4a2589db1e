"""Tree builders and scores, without any model: random marginals in, trees out."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from presto_sd.method.builders import (
    TreeParams,
    build_linear_tree,
    build_marginal_tree,
    build_presto_beam_tree,
    build_presto_best_first_tree,
    build_tree,
)
from presto_sd.method.ngram import NGramModel
from presto_sd.method.scores import (
    RHO_FLOOR,
    ConstantRho,
    DraftMarginals,
    LookupProposalRho,
    NGramRho,
    PrefixProposalRho,
    PrefixRho,
    ScoringContext,
)
from presto_sd.method.tree import TokenTree, TreeError, TreeLimits


def random_marginals(depth: int, k: int, vocab: int = 50, seed: int = 0) -> DraftMarginals:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * 2
    logp = torch.log_softmax(logits, -1)
    top = torch.topk(logp, k, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return DraftMarginals(top.indices, top.values, entropy, torch.randn(depth, 8, generator=g))


def ctx_for(m: DraftMarginals, context: list[int] | None = None) -> ScoringContext:
    context = context or [1, 2, 3, 4]
    ng = NGramModel(order=3, vocab_size=50)
    ng.update(context)
    return ScoringContext(m, context, ng)


def assert_well_formed(tree: TokenTree, budget: int, depth: int) -> None:
    tree.validate(TreeLimits(max_nodes=budget, max_depth=depth))
    assert tree.size <= budget and tree.max_depth <= depth
    for node in range(1, len(tree.tokens)):  # prefix-closed: siblings carry distinct tokens
        sibs = [tree.tokens[c] for c in tree.children(tree.parents[node])]
        assert len(sibs) == len(set(sibs))


def brute_force_top_b(m: DraftMarginals, budget: int, depth: int) -> set[tuple[int, ...]]:
    """All paths by cumulative log q, best B (the exact answer DDTree's heap must find)."""
    paths = {}
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(m.top_k), repeat=d):
            toks = tuple(int(m.token_ids[i, r]) for i, r in enumerate(ranks))
            paths[toks] = sum(float(m.log_probs[i, r]) for i, r in enumerate(ranks))
    return set(sorted(paths, key=lambda p: -paths[p])[:budget])


def node_paths(tree: TokenTree) -> set[tuple[int, ...]]:
    return {tuple(tree.path_tokens(i)[1:]) for i in range(1, len(tree.tokens))}


def test_linear_is_top1_chain():
    m = random_marginals(6, 4)
    b = build_linear_tree(7, m, TreeParams(budget=10, depth=5))
    assert b.tree.tokens == (7, *m.token_ids[:5, 0].tolist())
    assert b.tree.parents == (-1, 0, 1, 2, 3, 4)


@pytest.mark.parametrize("budget,depth", [(1, 1), (5, 3), (12, 3), (20, 4)])
def test_marginal_tree_is_exact_top_b(budget, depth):
    m = random_marginals(depth, 3, seed=budget)
    b = build_marginal_tree(0, m, TreeParams(budget=budget, depth=depth))
    assert_well_formed(b.tree, budget, depth)
    assert node_paths(b.tree) == brute_force_top_b(m, budget, depth)


def test_best_first_with_zero_lambda_is_marginal():
    m = random_marginals(8, 6, seed=3)
    ctx = ctx_for(m)
    params = TreeParams(budget=40, depth=8, lambdas=(0.0,))
    a = build_presto_best_first_tree(0, ctx, NGramRho(), params)
    b = build_marginal_tree(0, m, params)
    assert a.tree == b.tree and a.path_scores == b.path_scores


def test_presto_beam_with_zero_lambda_ranks_as_marginal():
    """lambda = 0: every node's score is its cumulative log q, whatever the rho provider."""
    m = random_marginals(8, 6, seed=4)
    ctx = ctx_for(m)
    params = TreeParams(budget=30, depth=8, branching=3, beam=3, lambdas=(0.0,))
    a = build_presto_beam_tree(0, ctx, NGramRho(), params)
    b = build_presto_beam_tree(0, ctx, ConstantRho(0.1), params)
    assert a.tree == b.tree
    rank_of = {(d, int(t)): float(m.log_probs[d, j]) for d in range(8) for j, t in enumerate(m.token_ids[d])}
    for i in range(1, len(a.tree.tokens)):
        path = a.tree.path_tokens(i)[1:]
        expected = sum(rank_of[(d, t)] for d, t in enumerate(path))
        assert a.path_scores[i] == pytest.approx(expected, abs=1e-5)


def test_beam_one_one_is_linear():
    m = random_marginals(6, 4)
    ctx = ctx_for(m)
    params = TreeParams(budget=6, depth=6, branching=1, beam=1, lambdas=(0.0,))
    beam = build_presto_beam_tree(9, ctx, NGramRho(), params)
    lin = build_linear_tree(9, m, TreeParams(budget=6, depth=6))
    assert beam.tree == lin.tree


def test_global_retention_keeps_paths_that_left_the_beam():
    m = random_marginals(5, 4, seed=7)
    ctx = ctx_for(m)
    b = build_presto_beam_tree(0, ctx, NGramRho(), TreeParams(budget=100, depth=5, branching=2, beam=1))
    # beam 1 x branching 2: two nodes per depth, and only one of them ever gets children
    assert b.tree.size == 10
    for d in range(1, 6):
        at_d = [i for i in range(len(b.tree.tokens)) if b.tree.depths[i] == d]
        assert len(at_d) == 2
        assert sum(1 for i in at_d if b.tree.children(i)) <= 1
        assert any(not b.tree.children(i) for i in at_d)  # a retained leaf that left the beam


def test_rho_reorders_paths():
    """A strong n-gram bigram makes presto prefer a continuation the marginals rank second."""
    m = random_marginals(2, 4, seed=11)
    second = int(m.token_ids[1, 1])
    first0 = int(m.token_ids[0, 0])
    ng = NGramModel(order=2, vocab_size=50)
    ng.update([first0, second] * 50)
    ctx = ScoringContext(m, [5, first0], ng)
    b = build_presto_beam_tree(5, ctx, NGramRho(), TreeParams(budget=2, depth=2, branching=1, beam=1))
    assert b.tree.tokens == (5, first0, second)


def test_lookup_proposal_folds_the_contexts_own_next_token_into_the_top_k():
    """``ngram-lookup``: where the request's counts have seen the node's last two tokens, the
    row's best token joins the candidates (the last slot, when the top-K lacks it) and every
    candidate's ``q`` is the mixture with that row; where they have not, it is ``ngram``."""
    m = random_marginals(4, 3, seed=5)
    outside = next(t for t in range(50) if t not in m.token_ids.flatten().tolist())
    context = [outside + 1, outside + 2, outside, 9, outside + 1, outside + 2]  # (a, b) -> outside, seen once
    ctx = ctx_for(m, context)
    rho = LookupProposalRho(NGramRho(), mix=0.5)
    tokens, log_q = rho.propose(ctx, 1, [[]], 3)
    assert tokens[0, 0] == outside and log_q[0, 0] == pytest.approx(math.log(0.5))  # (1 - mix) * 0 + mix * 1
    assert tokens[0, 1:].tolist() == m.token_ids[0, :2].tolist()  # the marginal's best two, scaled
    torch.testing.assert_close(log_q[0, 1:], m.log_probs[0, :2] + math.log(0.5))
    # a drafted path that leaves the seen history: that node gets the marginal's own top-K
    tokens, log_q = rho.propose(ctx, 2, [[outside], [17]], 3)
    assert tokens[1].tolist() == m.token_ids[1].tolist() and torch.equal(log_q[1], m.log_probs[1])
    # no counts at all, or mix 0: ngram's candidates and log q
    for quiet, r in ((ScoringContext(m, context), rho), (ctx, LookupProposalRho(NGramRho(), mix=0.0))):
        tokens, log_q = r.propose(quiet, 1, [[]], 3)
        assert torch.equal(tokens[0], m.token_ids[0]) and torch.equal(log_q[0], m.log_probs[0])
    # a tree follows what the context repeats, at lambda 0 too
    built = build_presto_best_first_tree(context[-1], ctx, rho, TreeParams(budget=3, depth=3, lambdas=(0.0,)))
    assert built.tree.tokens[1] == outside

    # over another proposal (a prefix head's children: ``prefix-lookup``), each row its own
    class Fixed:  # proposes [P, 3] per-row candidates
        wide = 0

        def propose(self, ctx, depth, prefixes, top_k):
            ids = torch.tensor([[40 + i, 41 + i, 42 + i] for i in range(len(prefixes))])
            return ids, torch.log(torch.tensor([[0.5, 0.3, 0.1]])).expand(len(prefixes), -1)

    over = LookupProposalRho(NGramRho(), base=Fixed(), mix=0.5)
    tokens, log_q = over.propose(ctx, 1, [[], [17]], 3)
    assert tokens[0].tolist() == [outside, 40, 41]  # the row's best in the last slot, mixed
    assert tokens[1].tolist() == [41, 42, 43]  # no row: the base's own
    torch.testing.assert_close(log_q[1].exp(), torch.tensor([0.5, 0.3, 0.1]))


def test_prefix_proposal_draws_each_nodes_children_from_its_parent():
    """``prefix-ngram``: a node's children are the top-K of the head's conditional given
    that node's token (not the marginal's top-K at its depth), with that conditional as
    their ``log q``; lambda 0 is best-first on the conditional alone."""
    vocab, hidden = 12, 8
    m = random_marginals(3, 3, vocab=vocab, seed=5)
    draft_ids = torch.arange(2, vocab)  # target ids 0 and 1 lie outside the draft vocabulary
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[draft_ids] = torch.arange(len(draft_ids))
    draft_head = torch.zeros(len(draft_ids), hidden)  # the marginal is flat: the parent decides

    n = len(draft_ids)  # a head of rank n: draft id p -> p + 1 (mod n), strongly; no gate
    prev = torch.cat([torch.eye(n), torch.zeros(1, n)])
    nxt = 8.0 * torch.eye(n).roll(1, dims=0)  # next[t] = 8 e_(t - 1)
    transition = (prev, torch.zeros(n, hidden), nxt)
    prefix = PrefixRho(draft_head, t2d, *transition)
    assert torch.equal(prefix.d2t, draft_ids)
    rho = PrefixProposalRho(prefix, NGramRho())
    anchor = 4
    built = build_presto_best_first_tree(anchor, ctx_for(m, [1, 2, anchor]), rho,
                                         TreeParams(budget=3, depth=3, lambdas=(0.0,)))
    assert built.tree.tokens == (anchor, 5, 6, 7)  # the chain each parent's conditional names
    beam = build_presto_beam_tree(anchor, ctx_for(m, [1, 2, anchor]), rho,
                                  TreeParams(budget=6, depth=3, branching=2, beam=2, lambdas=(0.0,)))
    for node in range(1, len(beam.tree.tokens)):  # a beam's frontier rows each get their own children
        parent_token = beam.tree.tokens[beam.tree.parents[node]]
        best_child = int(draft_ids[(t2d[parent_token] + 1) % n])
        assert best_child in [beam.tree.tokens[c] for c in beam.tree.children(beam.tree.parents[node])]
    ids, logp = prefix.conditional(ctx_for(m, [anchor]), 1, [[]])
    assert built.path_scores[1] == pytest.approx(float(logp[0, (ids == t2d[5]).nonzero()[0, 0]]))
    assert logp.exp().sum() == pytest.approx(1.0)  # the whole draft vocabulary is the support here
    tokens, log_q = rho.propose(ctx_for(m, [anchor]), 2, [[5], [9]], 3)
    assert tokens[:, 0].tolist() == [6, 10] and bool((log_q[:, :1] > log_q[:, 1:]).all())

    # the drafter hands in its top-M (no second lm_head matmul or top-k): the same conditional
    head = torch.randn(len(draft_ids), hidden, generator=torch.Generator().manual_seed(1))
    rich = PrefixRho(head, t2d, *transition)
    full = torch.log_softmax(m.hidden @ head.T, dim=-1)
    kept = DraftMarginals.top_of(full, m.top_k, m.hidden, wide=rich.wide)
    assert kept.wide_ids.shape == (m.depth, len(draft_ids))  # the support: the whole vocabulary here
    assert torch.equal(kept.token_ids, full.topk(m.top_k).indices)
    for d in (1, 2, 3):
        for a, b in zip(rich.conditional(ctx_for(kept, [anchor]), d, [[5], [7]]),
                        rich.conditional(ctx_for(m, [anchor]), d, [[5], [7]])):
            torch.testing.assert_close(a, b)

    # a support of the marginal's top 4: nothing else is proposed or scored above the floor,
    # and a token outside keeps its marginal mass in the normaliser
    narrow = PrefixRho(head, t2d, *transition, support=4)
    ctx = ctx_for(kept, [anchor])
    ids, logp = narrow.conditional(ctx, 2, [[5]])
    assert set(ids.tolist()) == set(full[1].topk(4).indices.tolist()) and logp.exp().sum() < 1
    proposed, _ = PrefixProposalRho(narrow, NGramRho()).propose(ctx, 2, [[5]], 10)
    assert set(t2d[proposed[0]].tolist()) == set(ids.tolist())
    outside = [t for t in draft_ids.tolist() if t2d[t] not in ids.tolist()]
    log_rho = narrow.log_rho(ctx, 2, [[5]], torch.tensor([outside + [0]]), None)
    assert torch.all(log_rho == math.log(RHO_FLOOR))
    # two heads scoring one round keep their own shares (the memo is per provider)
    both = ctx_for(kept, [anchor])
    assert len(rich.conditional(both, 2, [[5]])[0]) == len(draft_ids)
    assert len(narrow.conditional(both, 2, [[5]])[0]) == 4


def test_prefix_rho_is_the_heads_own_conditional():
    """With the whole vocabulary as support, ``PrefixRho`` gives ``log_softmax(logits +
    PrefixHead(h, parent))``: a gate that is not zero, a parent outside the draft vocabulary."""
    from presto_sd.models.dflash import PrefixHead

    g = torch.Generator().manual_seed(3)
    vocab, n, hidden, rank = 14, 10, 8, 4
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[4:] = torch.arange(n)
    head = PrefixHead(n, hidden, rank)
    with torch.no_grad():
        head.next.copy_(torch.randn(n, rank, generator=g))
        head.gate.weight.copy_(torch.randn(rank, hidden, generator=g))
    draft_head = torch.randn(n, hidden, generator=g)
    rho = PrefixRho(draft_head, t2d, head.prev.weight.detach(), head.gate.weight.detach(), head.next.detach())
    m = random_marginals(3, 3, vocab=vocab, seed=2)
    for d, parent in ((1, 9), (2, 0), (3, 13)):  # target id 0: outside the draft vocabulary
        ids, logp = rho.conditional(ctx_for(m, [parent]), d, [[]])
        h = m.hidden[d - 1]
        want = torch.log_softmax(h @ draft_head.T + head(h, t2d[parent]).detach(), dim=-1)
        torch.testing.assert_close(logp[0], want[ids])


def test_unknown_method_and_missing_rho():
    m = random_marginals(3, 3)
    with pytest.raises(ValueError, match="unknown"):
        build_tree("nope", 0, ctx_for(m), TreeParams())
    with pytest.raises(ValueError, match="rho"):
        build_tree("presto-beam", 0, ctx_for(m), TreeParams())


@settings(max_examples=60, deadline=None)
@given(
    method=st.sampled_from(["linear", "marginal", "presto-beam", "presto-best-first"]),
    budget=st.integers(1, 64),
    depth=st.integers(1, 15),
    k=st.integers(1, 8),
    branching=st.integers(1, 5),
    beam=st.integers(1, 5),
    lam=st.floats(0, 3),
    seed=st.integers(0, 10_000),
)
def test_builders_properties(method, budget, depth, k, branching, beam, lam, seed):
    m = random_marginals(15, k, seed=seed)
    params = TreeParams(budget=budget, depth=depth, branching=branching, beam=beam,
                        lambdas=(lam,))
    built = build_tree(method, 3, ctx_for(m), params, NGramRho())
    assert_well_formed(built.tree, budget, depth)
    assert built.tree.tokens[0] == 3
    # scores never grow along a path (what makes best-first exact and top-B prefix-closed)
    for i in range(1, len(built.tree.tokens)):
        assert built.path_scores[i] <= built.path_scores[built.tree.parents[i]] + 1e-6
    if method in ("marginal", "presto-best-first"):
        assert built.tree.size == min(budget, sum(k**d for d in range(1, depth + 1)))


# -- the tree type ----------------------------------------------------------------------


def test_tree_mask_and_positions():
    t = TokenTree.from_lists([5, 6, 7, 8], [-1, 0, 0, 1])
    assert t.position_ids(10).tolist() == [10, 11, 11, 12]
    mask = t.ancestor_mask()
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]


@pytest.mark.parametrize(
    "tokens,parents,depths,limits,match",
    [
        ((), (), (), TreeLimits(), "empty"),
        ((1, 2, 3), (-1, 2, 0), (0, 1, 1), TreeLimits(), r"parents\[1\]"),
        ((1, 2, 3), (-1, 0, 1), (0, 1, 1), TreeLimits(), r"depths\[2\]"),
        ((1, 2, 99), (-1, 0, 1), (0, 1, 2), TreeLimits(vocab_size=50), r"tokens\[2\] = 99"),
        ((1, 2, -1), (-1, 0, 1), (0, 1, 2), TreeLimits(vocab_size=50), r"tokens\[2\]"),
        ((1, 2, 3), (-1, 0, 1), (0, 1, 2), TreeLimits(max_nodes=1), "exceed"),
        ((1, 2, 3), (-1, 0, 1), (0, 1, 2), TreeLimits(max_depth=1), "depth"),
        ((1, 2), (0, 0), (0, 1), TreeLimits(), r"parents\[0\]"),
        ((1, 2), (-1,), (0,), TreeLimits(), "lengths"),
    ],
)
def test_tree_validation_names_the_problem(tokens, parents, depths, limits, match):
    with pytest.raises(TreeError, match=match):
        TokenTree(tokens, parents, depths).validate(limits)


def test_ngram_backoff_and_persistence(tmp_path):
    ng = NGramModel(order=3, vocab_size=10)
    ng.update([1, 2, 3, 1, 2, 3, 1, 2, 4])
    p = ng.probs([1, 2], [3, 4, 5])
    assert p[0] > p[1] > p[2] > 0
    assert float(ng.probs([7, 7], [3]).item()) == pytest.approx(float(ng.probs([], [3]).item()))
    ng.save(tmp_path / "t.json.gz")
    again = NGramModel.load(tmp_path / "t.json.gz")
    assert torch.allclose(again.probs([1, 2], [3, 4, 5]), p)
    assert math.isclose(float(ng.probs([1, 2], list(range(10))).sum()), 1.0, rel_tol=1e-5)


def test_hphi_with_the_ngram_feature_needs_the_ngram_and_reads_it():
    from presto_sd.method.scores import HPhi, LearnedRho

    m = random_marginals(3, 4)
    embed = torch.randn(50, 6)
    model = HPhi(hidden_size=8, embed_size=6, n_scalars=4).eval()
    with pytest.raises(ValueError, match="NGramRho"):
        LearnedRho(model, embed)
    ctx = ctx_for(m, [1, 2, 3, 4, 1, 2, 3])
    toks, log_q = m.token_ids[1][None], m.log_probs[1][None]
    with_table = LearnedRho(model, embed, NGramRho())
    a = with_table.log_rho(ctx, 2, [[int(m.token_ids[0, 0])]], toks, log_q)
    ctx.online_ngram = None  # the n-gram now knows nothing: the feature, and rho, change
    b = with_table.log_rho(ctx, 2, [[int(m.token_ids[0, 0])]], toks, log_q)
    assert a.shape == (1, 4) and not torch.allclose(a, b)
    old = HPhi(hidden_size=8, embed_size=6)  # checkpoints without the feature still load and run
    assert LearnedRho(old, embed).log_rho(ctx, 2, [[1]], toks, log_q).shape == (1, 4)
