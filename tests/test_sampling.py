"""Speculative sampling follows the target distribution (chi-square tests say so).

One verifier call: a tiny-vocabulary (V = 6) random target at temperature 1. The anchor
is fixed, a fixed tree of depth 3 is verified, and the first two output tokens (x1, x2)
are tabulated over N = 6000 independent sessions. The exact joint p(x1) p(x2 | x1) is
computed from the model. Pearson's chi-square goodness of fit (cells with expected
count < 5 pooled) must NOT reject at alpha = 0.001; as a control, a wrong acceptance
rule (accept a child whenever the target gives its token probability > 0.05, i.e.
"the drafter's token is plausible") must be rejected at p < 1e-6 on the same sample size.

Whole generations (T > 0 end to end; docs/design.md §1 states the same). H0: the first K
tokens of a speculative generation (the real loop, ``generate``; a DFlash drafter's trees,
``presto-best-first`` and ``taps``; several rounds) are distributed as plain sampling's:
temperature, top-k, top-p as transformers' own warpers apply them, one draw per token. The
exact joint of those K tokens is enumerated from the target's logits (every prefix of
non-zero probability). Statistics: for each t = 1..K-1 the pair (x_t, x_t+1) tabulated over
N generations (seeds 0..N-1) against its exact law by Pearson's chi-square, cells of
expected count < 5 pooled into one; a pair of probability 0 (outside top-k / top-p) rejects
outright. The K-1 p-values are combined by Bonferroni: H0 is rejected when
min p < ALPHA / (K-1), ALPHA = 1e-3 per method. Seeds are fixed, so a run is deterministic
and ALPHA is the chance that a correct sampler fails on the chosen seeds. Power
(``test_the_end_to_end_test_has_power``, noncentral chi-square): >= 0.99 against any
sampler whose law of some pair lies at chi-square divergence >= 0.12 from the exact one at
the default N = 600 (>= 0.025 at the slow set's N = 3000); the biased samplers of
``test_a_biased_sampler_fails_the_end_to_end_test`` (accept the first plausible child, walk
at T = 1, walk without top-k / top-p) are rejected at p < 1e-6 with N = 200. Pairs do not
see a bias that only couples tokens two or more apart. On the real target (SmolLM2 and the
shipped drafter, ``smollm2`` and ``slow``) the same test runs on K = 4 tokens, N = 400.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.method import acceptance
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.tree import TokenTree
from presto_sd.models.invariant import native_bf16
from tests.conftest import in_dtype, tiny_llama

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



# -- T > 0 end to end: whole generations through the loop, the drafter's trees, top-k, top-p --
E2E_V, E2E_K = 6, 5
E2E_N, E2E_N_SLOW, E2E_N_BIASED = 600, 3000, 200
E2E_PROMPT = [0, 3, 5, 1]
E2E_SAMPLING = SamplingParams(temperature=0.5, top_k=4, top_p=0.9)  # both filters cut here
ALPHA = 1e-3
# chi-square divergence of a pair's law from the exact one at which power >= 0.99, per N
E2E_DIVERGENCE = {E2E_N: 0.12, E2E_N_SLOW: 0.025}


def plain_sampling_probs(logits: torch.Tensor, s: SamplingParams) -> torch.Tensor:
    """What plain sampling draws from: transformers' warpers, independent of presto_sd's."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warp = LogitsProcessorList([TemperatureLogitsWarper(s.temperature), TopKLogitsWarper(s.top_k),
                                TopPLogitsWarper(s.top_p)])
    return torch.softmax(warp(None, logits.double()), dim=-1)


def exact_sequences(logits_of, prompt: list[int], k: int, s: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x_1..x_k) of every sequence of non-zero probability, one batched call per depth.
    ``logits_of``: a model (transformers' forward: the fp32 reference) or an engine's
    ``next_token_logits`` (its own law: in bf16 a batched transformers forward, or even a
    whole-sequence prefill, is not the arithmetic of the engine's AR steps)."""
    if isinstance(logits_of, torch.nn.Module):
        model = logits_of

        def logits_of(prompt: list[int], continuations: list[list[int]]) -> torch.Tensor:
            rows = torch.tensor([prompt + c for c in continuations])
            with torch.no_grad():  # the last position's logits only
                return model(rows, logits_to_keep=1).logits[:, -1]

    level: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(k):
        prefixes = [list(p) for p in level]
        logits = torch.cat([logits_of(prompt, prefixes[i : i + 64]) for i in range(0, len(prefixes), 64)])
        nxt = {}
        for p, row in zip(level, plain_sampling_probs(logits, s)):
            for tok in torch.nonzero(row).flatten().tolist():
                nxt[p + (tok,)] = level[p] * float(row[tok])
        level = nxt
    return level


def exact_pairs(joint: dict[tuple[int, ...], float]) -> list[dict[tuple[int, int], float]]:
    """The exact law of (x_t, x_t+1) for t = 1..K-1 (its support only), from the joint."""
    k = len(next(iter(joint)))
    tables: list[dict[tuple[int, int], float]] = [{} for _ in range(k - 1)]
    for seq, p in joint.items():
        for t in range(k - 1):
            tables[t][seq[t], seq[t + 1]] = tables[t].get((seq[t], seq[t + 1]), 0.0) + p
    return tables


def pooled_chi_square_p(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of counts against a law on the same cells, the cells of
    expected count < 5 pooled into one."""
    obs, exp = observed.double(), probs.double() * observed.sum()
    keep = exp >= 5
    o, e = obs[keep], exp[keep]
    if (~keep).any():
        o, e = torch.cat([o, obs[~keep].sum()[None]]), torch.cat([e, exp[~keep].sum()[None]])
    if len(e) < 2:  # one cell: chi-square has nothing to compare, and a p of 1.0 would pass anything
        raise ValueError(f"{int(observed.sum())} samples over {len(observed)} cells pool into one: "
                         "too few to test this law (draw more)")
    return float(chisquare(o.numpy(), e.numpy() * o.sum().item() / e.sum().item()).pvalue)


def pair_p_values(samples: torch.Tensor, tables: list[dict[tuple[int, int], float]]) -> list[float]:
    """One p-value per pair (x_t, x_t+1); 0 where a pair of probability 0 was drawn."""
    out = []
    for t, table in enumerate(tables):
        index = {cell: i for i, cell in enumerate(table)}
        counts, outside = torch.zeros(len(table)), 0
        for a, b in samples[:, t : t + 2].tolist():
            if (a, b) in index:
                counts[index[a, b]] += 1
            else:
                outside += 1
        out.append(0.0 if outside else pooled_chi_square_p(counts, torch.tensor(list(table.values()))))
    return out


def sampled_generations(verifier, drafter, method: str, n: int, seed0: int = 0, prompt=E2E_PROMPT,
                        k: int = E2E_K, sampling: SamplingParams = E2E_SAMPLING):
    """``n`` whole speculative generations of ``k`` tokens (seeds ``seed0``..): tokens [n, k]
    and every round's stats."""
    from presto_sd.loop.generate import GenerationParams, generate
    from presto_sd.method.builders import TreeParams

    tree = TreeParams(budget=16, depth=k - 1)
    samples, rounds = [], []
    for i in range(n):
        params = GenerationParams(method=method, tree=tree, max_new_tokens=k,
                                  sampling=replace(sampling, seed=seed0 + i))
        res = generate(verifier, drafter, prompt, params)
        samples.append(res.token_ids)
        rounds.extend(res.rounds)
    return torch.tensor(samples), rounds


def check_rounds(rounds, n: int, min_rounds: float, min_trees: float = 0.5, deep: int = 2,
                 deep_share: float = 0.05) -> None:
    """The sample exercised what it claims: several rounds, trees, and trees accepted ``deep``
    tokens deep in at least ``deep_share`` of the tree rounds."""
    trees = [r for r in rounds if r.tree_size > 0]
    assert len(rounds) >= min_rounds * n and len(trees) >= min_trees * len(rounds)
    assert sum(r.accepted >= deep for r in trees) >= deep_share * len(trees)


def hold_taps_open(monkeypatch) -> None:
    """TAPS's gate open: its rounds verify the trees it builds (as in test_lossless)."""
    from presto_sd.loop.taps_feedback import TapsFeedback

    monkeypatch.setattr(TapsFeedback, "should_draft", lambda self: True)


@pytest.fixture(scope="module")
def e2e_target():
    m = tiny_llama(vocab=E2E_V, layers=2, seed=3)
    with torch.no_grad():
        m.lm_head.weight.div_(2.0)  # sharp enough that the temperature matters, spread enough to sample
    return m


@pytest.fixture(scope="module")
def e2e_tables(e2e_target):
    return exact_pairs(exact_sequences(e2e_target, E2E_PROMPT, E2E_K, E2E_SAMPLING))


def e2e_engines_for(target, monkeypatch):
    """``target`` and a random DFlash drafter in its dtype; TAPS held open, on a flat cost
    (it fills its budget)."""
    from presto_sd.method.cost_model import CostFit, OnlineCostModel
    from presto_sd.models.dflash import DFlashConfig, DFlashDraftModel
    from presto_sd.models.loading import random_drafter_config
    from tests.conftest import make_engines

    torch.manual_seed(1)
    cfg = random_drafter_config(target.config, num_layers=1, block_size=8)
    cfg["dflash_config"]["target_layer_ids"] = [0, 1]
    drafter_model = DFlashDraftModel(DFlashConfig.from_dict(cfg)).to(target.dtype).eval()
    verifier, drafter = make_engines(target, drafter_model)
    hold_taps_open(monkeypatch)
    verifier.forward_costs = OnlineCostModel(prior=CostFit(0.05, 0.0, 0.0, 0.0))
    verifier.forward_costs.observe = lambda *a: None
    return verifier, drafter


@pytest.fixture()
def e2e_engines(e2e_target, monkeypatch):
    return e2e_engines_for(e2e_target, monkeypatch)


@pytest.mark.parametrize("n", [E2E_N, pytest.param(E2E_N_SLOW, marks=pytest.mark.slow)])
@pytest.mark.parametrize("method", ["presto-best-first", "taps"])
def test_whole_generations_at_t_above_0_sample_as_plain_sampling(e2e_engines, e2e_tables, method, n):
    samples, rounds = sampled_generations(*e2e_engines, method, n)
    check_rounds(rounds, n, min_rounds=1.5)
    p = pair_p_values(samples, e2e_tables)
    assert min(p) > ALPHA / len(p), f"{method}: the output deviates from plain sampling (pair p = {p})"


@pytest.mark.skipif(not native_bf16(), reason="no native bf16 on this CPU: bf16 is never the default here")
def test_whole_generations_sample_as_plain_sampling_in_bf16(e2e_target, monkeypatch):
    """The same test in bf16 (the CPU default where it is native): the law is bf16's own."""
    target = in_dtype(e2e_target, torch.bfloat16)
    verifier, drafter = e2e_engines_for(target, monkeypatch)
    samples, rounds = sampled_generations(verifier, drafter, "presto-best-first", E2E_N)
    check_rounds(rounds, E2E_N, min_rounds=1.5)
    law = exact_sequences(verifier.next_token_logits, E2E_PROMPT, E2E_K, E2E_SAMPLING)
    p = pair_p_values(samples, exact_pairs(law))
    assert min(p) > ALPHA / len(p), f"bf16: the output deviates from plain sampling (pair p = {p})"


def _biased_walk(flaw: str):
    right = acceptance.walk_tree

    def walk(tree, logits_at, sampling, generator=None):
        if flaw == "walk at T = 1":  # the prefill draws at the request's temperature, the walk not
            return right(tree, logits_at, replace(sampling, temperature=1.0), generator)
        if flaw == "walk without top-k / top-p":
            return right(tree, logits_at, replace(sampling, top_k=0, top_p=1.0), generator)
        node, path = 0, [0]  # "accept the first plausible child"
        while True:
            logits = logits_at(node)
            probs = acceptance.sampling_probs(logits, sampling)
            plausible = [c for c in tree.children(node) if probs[tree.tokens[c]] > 0.1]
            if not plausible:
                return acceptance.WalkResult(path, acceptance.sample_token(logits, sampling, generator))
            node = plausible[0]
            path.append(node)

    return walk


@pytest.mark.parametrize("flaw", ["accept the first plausible child", "walk at T = 1",
                                  "walk without top-k / top-p"])
def test_a_biased_sampler_fails_the_end_to_end_test(e2e_engines, e2e_tables, flaw, monkeypatch):
    monkeypatch.setattr("presto_sd.embedded.hf_verifier.walk_tree", _biased_walk(flaw))
    samples, _ = sampled_generations(*e2e_engines, "presto-best-first", E2E_N_BIASED)
    p = pair_p_values(samples, e2e_tables)
    assert min(p) < 1e-6, f"{flaw}: not caught (pair p = {p})"


def test_the_end_to_end_test_has_power(e2e_tables):
    """Power >= 0.99 at E2E_DIVERGENCE: noncentral chi-square, the pooled cells' degrees of
    freedom, lambda = N * divergence, the Bonferroni level."""
    from scipy.stats import chi2, ncx2

    for n, divergence in E2E_DIVERGENCE.items():
        for table in e2e_tables:
            probs = torch.tensor(list(table.values()))
            df = int((probs * n >= 5).sum()) + int((probs * n < 5).any()) - 1
            power = ncx2.sf(chi2.ppf(1 - ALPHA / len(e2e_tables), df), df, n * divergence)
            assert power >= 0.99, (n, df, power)


SMOLLM2_K, SMOLLM2_N = 4, 400
SMOLLM2_SAMPLING = SamplingParams(temperature=1.0, top_k=4, top_p=0.95)


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.timeout(1800)  # ~6 min on 2 quiet cores: a stall fails instead of holding CI
def test_smollm2_whole_generations_at_t_above_0_sample_as_plain_sampling(monkeypatch):
    """The same test on SmolLM2-135M-Instruct and its shipped drafter: a chat prompt, K = 4,
    N = 400 generations, half presto-best-first and half taps (seeds apart; a mixture of
    exact samplers is exact, so one test covers both)."""
    from presto_sd.app.generate import encode_prompt
    from presto_sd.embedded.stack import build_embedded

    stack = build_embedded(device=torch.device("cpu"))
    prompt = encode_prompt(stack.tokenizer, "Write one sentence about the sea.", chat=True)
    # the engine's own law: its bf16 logits are row-invariant, a batched transformers forward's not
    law = exact_sequences(stack.verifier.next_token_logits, prompt, SMOLLM2_K, SMOLLM2_SAMPLING)
    tables = exact_pairs(law)
    hold_taps_open(monkeypatch)
    half, samples, rounds = SMOLLM2_N // 2, [], []
    for i, method in enumerate(("presto-best-first", "taps")):
        s, r = sampled_generations(stack.verifier, stack.drafter, method, half, seed0=i * half, prompt=prompt,
                                   k=SMOLLM2_K, sampling=SMOLLM2_SAMPLING)
        samples.append(s)
        rounds.extend(r)
    # K = 4 leaves trees of depth <= 2; at T = 1 a round keeps 2 draft tokens ~1 % of the time
    check_rounds(rounds, SMOLLM2_N, min_rounds=1.5, min_trees=0.3, deep=1, deep_share=0.3)
    p = pair_p_values(torch.cat(samples), tables)
    assert min(p) > ALPHA / len(p), f"the output deviates from plain sampling (pair p = {p})"
