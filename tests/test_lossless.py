"""Greedy speculative decoding is token-for-token plain AR greedy decoding, for every method."""

from __future__ import annotations

import pytest
import torch

from presto_sd.engine.drafter import Drafter, DrafterInfo, DraftResult
from presto_sd.loop.generate import GenerationParams, generate
from presto_sd.method.builders import TreeParams
from presto_sd.method.scores import DraftMarginals
from presto_sd.method.tree import TokenTree
from tests.conftest import hf_greedy, make_engines, tiny_llama

METHODS = ["linear", "marginal", "presto-beam", "presto-best-first", "taps"]
PROMPTS = [[0, 3, 5, 7], [0, 1, 1, 2, 3, 5, 8, 13], [0, 9]]


def run(verifier, drafter, prompt, method, n, **tree):
    params = GenerationParams(method=method, tree=TreeParams(**tree), max_new_tokens=n)
    return generate(verifier, drafter, prompt, params)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget,depth", [(1, 1), (4, 3), (16, 15), (64, 8), (64, 15)])
def test_greedy_equals_ar(tiny_target, method, budget, depth):
    verifier, drafter = make_engines(tiny_target)
    for prompt in PROMPTS:
        res = run(verifier, drafter, prompt, method, 24, budget=budget, depth=depth)
        assert res.token_ids == hf_greedy(tiny_target, prompt, 24), (method, budget, depth, prompt)
        assert all(r.tree_size <= budget for r in res.rounds)
    assert not verifier.sessions and not drafter.sessions  # closed when done


@pytest.mark.parametrize("budget,depth", [(4, 3), (16, 15), (64, 8)])
def test_taps_greedy_equals_ar_with_the_draft_gate_held_open(tiny_target, monkeypatch, budget, depth):
    """The gate turns rounds that do not pay into AR steps, which thins the taps cases
    above; held open, every round verifies a tree TAPS chose."""
    from presto_sd.loop.taps_feedback import TapsFeedback

    monkeypatch.setattr(TapsFeedback, "should_draft", lambda self: True)
    verifier, drafter = make_engines(tiny_target)
    trees = 0
    for prompt in PROMPTS:
        res = run(verifier, drafter, prompt, "taps", 24, budget=budget, depth=depth)
        assert res.token_ids == hf_greedy(tiny_target, prompt, 24), (budget, depth, prompt)
        assert not any(r.gated for r in res.rounds)
        trees += sum(r.tree_size > 0 for r in res.rounds)
    assert trees >= 5  # the tiny model's trees are cheap: most rounds keep one


@pytest.mark.parametrize("method", ["presto-beam", "presto-best-first", "taps"])
@pytest.mark.parametrize("budget,depth", [(4, 3), (16, 15)])
def test_greedy_equals_ar_with_the_lookup_proposal(tiny_target, method, budget, depth):
    """``ngram-lookup`` proposes tokens from the request's own counts, outside the
    drafter's top-K too: what it proposes is verified as any node is."""
    verifier, drafter = make_engines(tiny_target)
    for prompt in [[0, 3, 5, 7, 0, 3, 5, 7, 0, 3], *PROMPTS]:  # a repeat, for the lookup to fire
        res = run(verifier, drafter, prompt, method, 24, budget=budget, depth=depth, rho="ngram-lookup",
                  lambdas=(0.25,))
        assert res.token_ids == hf_greedy(tiny_target, prompt, 24), (method, budget, depth, prompt)


@pytest.mark.parametrize("kv_heads", [1, 4])  # multi-query and plain multi-head too
def test_greedy_equals_ar_other_attention_layouts(kv_heads):
    target = tiny_llama(kv_heads=kv_heads, seed=5)
    verifier, drafter = make_engines(target)
    for method in METHODS:
        res = run(verifier, drafter, PROMPTS[1], method, 20, budget=32, depth=6)
        assert res.token_ids == hf_greedy(target, PROMPTS[1], 20)


def test_trees_really_accept(tiny_target):
    """With 16 tokens and top-10 candidates the random drafter's trees often hold the
    target's token: these equality tests exercise real multi-token acceptance."""
    verifier, drafter = make_engines(tiny_target)
    res = run(verifier, drafter, PROMPTS[0], "marginal", 48, budget=64, depth=15)
    assert res.tau > 1.5


class OracleDrafter(Drafter):
    """Test double: a tree holding the target's own greedy continuation among decoys,
    placed at shuffled node indices, so acceptance runs deep and off the node order."""

    def __init__(self, target, vocab: int = 16, seed: int = 0):
        self.target, self.vocab = target, vocab
        self.g = torch.Generator().manual_seed(seed)
        self.tokens: dict[str, list[int]] = {}

    def info(self):
        return DrafterInfo(16, (0, 2), 15, self.vocab, ("oracle",), ())

    def prefill(self, session_id, delta, restart=False):
        self.tokens[session_id] = list(delta.tokens)
        return delta.end

    def commit(self, session_id, delta):
        self.tokens[session_id].extend(delta.tokens)
        return len(self.tokens[session_id])

    def close(self, session_id):
        self.tokens.pop(session_id)

    def draft(self, session_id, anchor, base, method, params, context=None):
        ctx = self.tokens[session_id] + [anchor]
        truth = hf_greedy(self.target, ctx, params.depth)
        keep = int(torch.randint(1, params.depth + 1, (1,), generator=self.g))
        tokens, parents, parent = [anchor], [-1], 0
        for t in truth[:keep]:
            decoy = (t + 1 + int(torch.randint(0, self.vocab - 1, (1,), generator=self.g))) % self.vocab
            first = int(torch.randint(0, 2, (1,), generator=self.g))
            pair = [decoy, t] if first else [t, decoy]
            base_idx = len(tokens)
            tokens += pair
            parents += [parent, parent]
            parent = base_idx + (1 if first else 0)
        tree = TokenTree.from_lists(tokens, parents)
        empty = DraftMarginals(torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1), torch.zeros(0))
        return DraftResult(tree, empty, tuple([0.0] * len(tokens)), 0.0, 0.0)


def test_deep_acceptance_off_the_node_order(tiny_target):
    verifier, _ = make_engines(tiny_target)
    oracle = OracleDrafter(tiny_target)
    for prompt in PROMPTS:
        res = run(verifier, oracle, prompt, "linear", 40, depth=10)
        assert res.token_ids == hf_greedy(tiny_target, prompt, 40)
        assert res.tau > 3


def test_eos_inside_an_accepted_path_ends_the_output(tiny_target):
    verifier, _ = make_engines(tiny_target)
    ref = hf_greedy(tiny_target, PROMPTS[0], 30)
    eos = ref[12]
    cut = ref.index(eos) + 1
    params = GenerationParams(method="linear", tree=TreeParams(depth=10),
                              max_new_tokens=30, stop_token_ids=(eos,))
    res = generate(verifier, OracleDrafter(tiny_target), PROMPTS[0], params)
    assert res.token_ids == ref[:cut] and res.finish_reason == "eos"


def test_stop_strings(tiny_target):
    verifier, drafter = make_engines(tiny_target)
    ref = hf_greedy(tiny_target, PROMPTS[0], 20)

    def detok(ids):
        return " ".join(map(str, ids))

    stop = f"{ref[5]} {ref[6]}"
    params = GenerationParams(method="marginal", tree=TreeParams(budget=16),
                              max_new_tokens=20, stop_strings=(stop,))
    res = generate(verifier, drafter, PROMPTS[0], params, detokenize=detok)
    assert res.finish_reason == "stop"
    assert stop in detok(res.token_ids) and res.token_ids == ref[: len(res.token_ids)]


@pytest.mark.smollm2
def test_smollm2_greedy_equals_ar(two_threads):
    """Once on the real target: SmolLM2-135M-Instruct, a few chat prompts, 32 tokens, in fp32
    against transformers' own ``generate`` (bf16 is held to the engine's own AR, bitwise:
    ``test_invariance.py``)."""
    from presto_sd.app.generate import encode_prompt
    from presto_sd.embedded.stack import build_embedded

    stack = build_embedded(device=torch.device("cpu"), dtype=torch.float32)
    tok, model = stack.tokenizer, stack.verifier.model
    for text in ["What is the capital of France?", "Write a Python function that reverses a string."]:
        prompt = encode_prompt(tok, text, chat=True)
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):]
        ref = ref.tolist()
        for method in ["ar", *METHODS]:
            params = GenerationParams(method=method, tree=TreeParams(budget=16),
                                      max_new_tokens=32, stop_token_ids=stack.verifier.eos_token_ids)
            res = generate(stack.verifier, stack.drafter, prompt, params)
            assert res.token_ids == ref, method


def test_taps_trees_really_reach_the_verifier(tiny_target):
    """Whatever cost the tiny model measures, a flat cost makes TAPS fill its cap: the
    taps equality tests above then exercise real trees, not AR steps."""
    from presto_sd.method.cost_model import CostFit, OnlineCostModel

    verifier, drafter = make_engines(tiny_target)
    verifier.forward_costs = OnlineCostModel(prior=CostFit(0.05, 0.0, 0.0, 0.0))
    verifier.forward_costs.observe = lambda *a: None  # keep it flat: this test is about trees
    res = run(verifier, drafter, PROMPTS[0], "taps", 24, budget=16, depth=8)
    assert res.token_ids == hf_greedy(tiny_target, PROMPTS[0], 24)
    assert max(r.tree_size for r in res.rounds) > 4
    calibrated, _ = make_engines(tiny_target)
    res = run(calibrated, drafter, PROMPTS[1], "taps", 24, budget=16, depth=8)
    assert res.token_ids == hf_greedy(tiny_target, PROMPTS[1], 24)
    assert calibrated.cost_model() is not None  # the loop calibrated it on first use
