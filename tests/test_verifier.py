"""The verifier: tree attention equals causal attention, KV compaction equals AR KV, bad input."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.engine.messages import (
    InvalidArgumentError,
    LimitExceededError,
    SessionNotFoundError,
    StaleBaseError,
    session_tag,
)
from presto_sd.engine.verifier import VerifierLimits
from presto_sd.method.tree import TokenTree
from presto_sd.models.packed import Segment
from tests.conftest import hf_greedy, in_dtype

PROMPT = [0, 3, 5, 7, 2, 9, 4]
# root, then 3 children; a grandchild under the 2nd and 3rd; a depth-3 node under the 3rd's child
TREE_PARENTS = [-1, 0, 0, 0, 2, 3, 5]
TREE_TOKENS_REST = [1, 6, 11, 8, 12, 3]

LOGIT_ATOL = 1e-4  # fp32: same math, different matmul shapes


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_tree_logits_equal_causal_path_logits(tiny_target):
    v = HFVerifier(tiny_target, (0, 2))
    pre = v.prefill("s", PROMPT)
    tree = TokenTree.from_lists([pre.anchor, *TREE_TOKENS_REST], TREE_PARENTS)
    s = v.sessions["s"]
    seg = Segment(s.kv, 0, len(tree.tokens), tree.paths())
    with torch.inference_mode():  # the session's buffers are inference tensors
        hidden, _ = v.runner.forward([seg], list(tree.tokens), tree.position_ids(len(PROMPT)))
        logits = v.runner.logits(hidden)
    for node in range(len(tree.tokens)):
        ref = full_logits(tiny_target, PROMPT + tree.path_tokens(node))[-1]
        torch.testing.assert_close(logits[node], ref, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_next_token_logits_are_a_rounds_logits_bitwise(tiny_target, dtype):
    """``next_token_logits`` (no session) reads bitwise what a round's walk reads at each
    node, the continuations one a call or all at once; it opens no session."""
    v = HFVerifier(in_dtype(tiny_target, dtype), (0, 2))
    pre = v.prefill("s", PROMPT)
    tree = TokenTree.from_lists([pre.anchor, *TREE_TOKENS_REST], TREE_PARENTS)
    seg = Segment(v.sessions["s"].kv, 0, len(tree.tokens), tree.paths())
    with torch.inference_mode():
        hidden, _ = v.runner.forward([seg], list(tree.tokens), tree.position_ids(len(PROMPT)))
        walked = v.runner.logits(hidden)
    paths = [tree.path_tokens(node) for node in range(len(tree.tokens))]
    assert torch.equal(v.next_token_logits(PROMPT, paths), walked)
    for node, path in enumerate(paths):
        assert torch.equal(v.next_token_logits(PROMPT, [path])[0], walked[node])
    # the empty continuation: the prefill's own last row, the law of the first token
    greedy = v.next_token_logits(PROMPT, [[]]).argmax(-1).item()
    assert greedy == v.prefill("t", PROMPT).anchor
    assert set(v.sessions) == {"s", "t"}
    with pytest.raises(ValueError, match="empty prompt"):
        v.next_token_logits([], [[1]])


def test_compacted_kv_equals_ar_kv(tiny_target):
    """Accept a path that is not a prefix of the node list; the KV must be AR's KV."""
    v = HFVerifier(tiny_target, (0, 2))
    pre = v.prefill("s", PROMPT)
    greedy = hf_greedy(tiny_target, PROMPT, 6)
    assert greedy[0] == pre.anchor
    # decoys first, so the true path sits at non-contiguous node indices
    g1, g2 = greedy[1], greedy[2]
    toks = [pre.anchor, (g1 + 1) % 16, (g1 + 2) % 16, g1, (g2 + 1) % 16, g2]
    tree = TokenTree.from_lists(toks, [-1, 0, 0, 0, 3, 3])
    res = v.verify("s", pre.base, tree)
    assert res.accepted == tuple(greedy[1:3]) and res.bonus == greedy[3]
    assert res.accepted_nodes == (0, 3, 5)
    committed = PROMPT + list(greedy[:3])
    ref = DynamicCache()
    with torch.no_grad():
        tiny_target(torch.tensor([committed]), past_key_values=ref, use_cache=True)
    kv = v.sessions["s"].kv
    for layer, theirs in enumerate(ref.layers):
        keys, values = kv.committed(layer)
        torch.testing.assert_close(keys, theirs.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(values, theirs.values, atol=1e-5, rtol=0)
    # the feature delta covers the anchor and the accepted tokens, at the old base
    assert res.delta.start == len(PROMPT) and res.delta.tokens == tuple(greedy[:3])
    assert res.base == len(PROMPT) + 3


def test_node_probs_are_target_probabilities(tiny_target):
    v = HFVerifier(tiny_target, (0, 2))
    pre = v.prefill("s", PROMPT)
    tree = TokenTree.from_lists([pre.anchor, *TREE_TOKENS_REST], TREE_PARENTS)
    res = v.verify("s", pre.base, tree, want_node_probs=True)
    for node in range(1, len(tree.tokens)):
        parent_path = PROMPT + tree.path_tokens(tree.parents[node])
        p = torch.softmax(full_logits(tiny_target, parent_path)[-1], -1)[tree.tokens[node]]
        assert float(res.node_probs[node]) == pytest.approx(float(p), abs=1e-4)


def test_step_is_ar(tiny_target):
    v = HFVerifier(tiny_target, (0, 2))
    pre = v.prefill("s", PROMPT)
    out, base = [pre.anchor], pre.base
    for _ in range(7):
        r = v.step("s", base, out[-1])
        out.append(r.bonus)
        base = r.base
    assert out == hf_greedy(tiny_target, PROMPT, 8)


@pytest.mark.parametrize(
    "tokens,parents,match",
    [
        (None, [-1, 2, 0], r"parents\[1\]"),  # parent after child
        (None, [-1, 0, 0, 5], r"parents\[3\]"),
        ("oob", [-1, 0], r"tokens\[1\] = 16"),  # token out of range
        ("root", [-1, 0], "anchor"),  # root is not the session's anchor
        ("big", None, "exceed"),  # over the node limit: RESOURCE_EXHAUSTED, not malformed
    ],
)
def test_bad_trees_are_refused_and_the_session_survives(tiny_target, tokens, parents, match):
    v = HFVerifier(tiny_target, (0, 2), limits=VerifierLimits(tree=__import__(
        "presto_sd.method.tree", fromlist=["TreeLimits"]).TreeLimits(max_nodes=8)))
    pre = v.prefill("s", PROMPT)
    a = pre.anchor
    if tokens == "big":
        tree = TokenTree.from_lists([a] + [1] * 9, [-1] + list(range(9)))
    elif tokens == "oob":
        tree = TokenTree.from_lists([a, 16], parents)
    elif tokens == "root":
        tree = TokenTree.from_lists([(a + 1) % 16, 1], parents)
    else:
        tree = TokenTree.from_lists([a] + [1] * (len(parents) - 1), parents)
    with pytest.raises(LimitExceededError if tokens == "big" else InvalidArgumentError, match=match):
        v.verify("s", pre.base, tree)
    # nothing was touched: the session goes on exactly as AR
    out, base = [a], pre.base
    for _ in range(4):
        r = v.step("s", base, out[-1])
        out.append(r.bonus)
        base = r.base
    assert out == hf_greedy(tiny_target, PROMPT, 5)


def test_wrong_depths_are_refused(tiny_target):
    v = HFVerifier(tiny_target, (0, 2))
    pre = v.prefill("s", PROMPT)
    tree = TokenTree((pre.anchor, 1, 2), (-1, 0, 0), (0, 1, 2))
    with pytest.raises(InvalidArgumentError, match=r"depths\[2\]"):
        v.verify("s", pre.base, tree)


def test_empty_tree_and_prompt_are_refused(tiny_target):
    v = HFVerifier(tiny_target, (0, 2))
    with pytest.raises(InvalidArgumentError, match="empty"):
        v.prefill("s", [])
    pre = v.prefill("s", PROMPT)
    with pytest.raises(InvalidArgumentError, match="empty"):
        v.verify("s", pre.base, TokenTree((), (), ()))


def test_unknown_session_and_stale_base(tiny_target):
    v = HFVerifier(tiny_target, (0, 2))
    with pytest.raises(SessionNotFoundError, match=session_tag("nope")):  # a hash, not the id
        v.step("nope", 0, 0)
    pre = v.prefill("s", PROMPT)
    with pytest.raises(StaleBaseError, match="stale base 3"):
        v.step("s", 3, pre.anchor)
    r = v.step("s", pre.base, pre.anchor)
    with pytest.raises(StaleBaseError):
        v.step("s", pre.base, pre.anchor)  # a replayed call: refused, not applied twice
    assert v.step("s", r.base, r.bonus).base == r.base + 1
    v.close("s")
    with pytest.raises(SessionNotFoundError):
        v.close("s")


def test_limits(tiny_target):
    v = HFVerifier(tiny_target, (0, 2), limits=VerifierLimits(max_sessions=1, max_context=12))
    with pytest.raises(LimitExceededError, match="max_context"):
        v.prefill("a", list(range(12)))
    pre = v.prefill("a", PROMPT)
    with pytest.raises(LimitExceededError, match="sessions"):
        v.prefill("b", PROMPT)
    deep = TokenTree.from_lists([pre.anchor] + [1] * 6, [-1, 0, 1, 2, 3, 4, 5])
    with pytest.raises(LimitExceededError, match="max_context"):
        v.verify("a", pre.base, deep)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        v.prefill("a", [0, 99])


def test_a_failed_forward_leaves_the_session_intact(tiny_target, monkeypatch):
    v = HFVerifier(tiny_target, (0, 2))
    pre = v.prefill("s", PROMPT)
    tree = TokenTree.from_lists([pre.anchor, *TREE_TOKENS_REST], TREE_PARENTS)

    def boom(*args, **kwargs):
        raise RuntimeError("simulated failure after the KV cache grew")

    monkeypatch.setattr("presto_sd.embedded.hf_verifier.walk_tree", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        v.verify("s", pre.base, tree)
    monkeypatch.undo()
    assert v.sessions["s"].kv.length == len(PROMPT)
    out, base = [pre.anchor], pre.base
    for _ in range(4):
        r = v.step("s", base, out[-1])
        out.append(r.bonus)
        base = r.base
    assert out == hf_greedy(tiny_target, PROMPT, 5)
