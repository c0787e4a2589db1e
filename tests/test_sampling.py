"""Speculative sampling follows the target distribution (a chi-square test says so).

Test: a tiny-vocabulary (V = 6) random target at temperature 1. The anchor is fixed, a
fixed tree of depth 3 is verified, and the first two output tokens (x1, x2) are
tabulated over N = 6000 independent sessions. The exact joint p(x1) p(x2 | x1) is
computed from the model. Pearson's chi-square goodness of fit (cells with expected
count < 5 pooled) must NOT reject at alpha = 0.001; as a control, a wrong acceptance
rule (accept a child whenever the target gives its token probability > 0.05, i.e.
"the drafter's token is plausible") must be rejected at p < 1e-6 on the same sample size.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.method import acceptance
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.tree import TokenTree
from tests.conftest import tiny_llama

V = 6
N = 6000
PROMPT = [0, 3, 5, 1]
ANCHOR = 2


def exact_joint(model) -> torch.Tensor:
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([PROMPT + [ANCHOR]])).logits[0, -1].float(), -1)
        rows = []
        for x1 in range(V):
            logits = model(torch.tensor([PROMPT + [ANCHOR, x1]])).logits[0, -1].float()
            rows.append(p1[x1] * torch.softmax(logits, -1))
    return torch.stack(rows)  # [V, V]


def tree_for() -> TokenTree:
    # the root's children cover half the vocabulary; deeper branches are arbitrary
    return TokenTree.from_lists([ANCHOR, 0, 1, 2, 3, 4, 0, 5, 1], [-1, 0, 0, 0, 1, 1, 2, 4, 7])


def sample_pairs(model) -> torch.Tensor:
    v = HFVerifier(model, (0, 1))
    counts = torch.zeros(V, V)
    tree = tree_for()
    for i in range(N):
        pre = v.prefill("s", PROMPT, SamplingParams(temperature=1.0, seed=i), anchor=ANCHOR)
        res = v.verify("s", pre.base, tree)
        out = list(res.new_tokens)
        if len(out) < 2:
            out.append(v.step("s", res.base, res.bonus).bonus)
        counts[out[0], out[1]] += 1
        v.close("s")
    return counts


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = (probs * counts.sum()).flatten()
    observed = counts.flatten()
    order = torch.argsort(expected)
    small = expected[order] < 5  # pool the sparse cells into one
    exp, obs = expected[order][~small], observed[order][~small]
    if small.any():
        exp = torch.cat([exp, expected[order][small].sum()[None]])
        obs = torch.cat([obs, observed[order][small].sum()[None]])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.fixture(scope="module")
def model():
    m = tiny_llama(vocab=V, seed=3)
    with torch.no_grad():
        m.lm_head.weight.div_(8.0)  # undo the fixture's sharpening: we want a spread distribution
    return m


def test_speculative_sampling_matches_target(model):
    p = chi_square_p(sample_pairs(model), exact_joint(model))
    assert p > 1e-3, f"speculative sampling deviates from the target (chi-square p = {p:.2e})"


def test_a_wrong_acceptance_rule_is_caught(model, monkeypatch):
    right = acceptance.sample_token

    def plausible_walk(tree, logits_at, sampling, generator):
        node, path = 0, [0]
        while True:
            logits = logits_at(node)
            probs = torch.softmax(logits, -1)
            plausible = [c for c in tree.children(node) if probs[tree.tokens[c]] > 0.05]
            if not plausible:
                return acceptance.WalkResult(path, right(logits, sampling, generator))
            node = plausible[0]
            path.append(node)

    monkeypatch.setattr("presto_sd.embedded.hf_verifier.walk_tree", plausible_walk)
    p = chi_square_p(sample_pairs(model), exact_joint(model))
    assert p < 1e-6, f"the test failed to catch a biased acceptance rule (p = {p:.2e})"


def test_seeded_sampling_is_reproducible(model):
    v = HFVerifier(model, (0, 1))
    outs = []
    for _ in range(2):
        pre = v.prefill("s", PROMPT, SamplingParams(temperature=0.8, top_p=0.9, top_k=4, seed=7))
        res = v.verify("s", pre.base, TokenTree.from_lists([pre.anchor, 1, 2], [-1, 0, 1]))
        outs.append((pre.anchor, res.new_tokens))
        v.close("s")
    assert outs[0] == outs[1]


def test_top_k_top_p_filtering():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = acceptance.sampling_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and p[:2].sum() == pytest.approx(1.0)
    p = acceptance.sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0] == pytest.approx(1.0)  # the top token alone already holds > 50 %
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)
