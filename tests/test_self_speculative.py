"""Self-speculative mode: the target drafts its next block at mask rows of the verify forward.

Mask rows never change a real row (bitwise), the adapter off is the base model, the
serving arithmetic of the mask rows is the training arithmetic, every method stays
lossless, bad chains are refused without changing the session, and the adapter trains.
"""

from __future__ import annotations

import random

import pytest
import torch

from presto_sd.app.training.train_self import (
    SelfTrainConfig,
    chain_loss,
    make_batch,
    train_self_draft,
    window,
)
from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.embedded.self_drafter import SelfDrafter, self_round_cost
from presto_sd.engine.messages import InvalidArgumentError
from presto_sd.engine.verifier import MaskChains
from presto_sd.loop.generate import GenerationParams, generate
from presto_sd.method.builders import TreeParams
from presto_sd.method.cost_model import CostFit
from presto_sd.method.tree import TokenTree
from presto_sd.models.self_draft import CONFIG_FILE as CONFIG
from presto_sd.models.self_draft import SelfDraftAdapter, mask_chain_forward, real_pass
from tests.conftest import hf_greedy, in_dtype, tiny_llama

METHODS = ["linear", "marginal", "presto-beam", "presto-best-first", "taps"]
PROMPTS = [[0, 3, 5, 7], [0, 1, 1, 2, 3, 5, 8, 13], [0, 9]]
TREE = TokenTree.from_lists([5, 3, 7, 2, 9], [-1, 0, 0, 1, 1])


def random_adapter(model, block: int = 4, seed: int = 3) -> SelfDraftAdapter:
    """An adapter whose delta is far from zero: mask rows differ from any real token's."""
    adapter = SelfDraftAdapter.for_model(model, block, rank=4)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.normal_(0, 0.5)
    return adapter.to(model.dtype).requires_grad_(False)


def verifier_for(model, adapter=None) -> HFVerifier:
    return HFVerifier(model, (0, 2), name="tiny-llama", adapter=adapter, decoder="owned")


def prefill_at_anchor(verifier: HFVerifier, sid: str, prompt: list[int], anchor: int) -> int:
    return verifier.prefill(sid, prompt, anchor=anchor).base


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=32, seed=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_rows_never_change_a_real_row(target, dtype):
    model = in_dtype(target, dtype)
    plain, adapted = verifier_for(model), verifier_for(model, random_adapter(model))
    prompt = [0, 4, 8, 15, 16, 23]
    for v in (plain, adapted):
        prefill_at_anchor(v, "s", prompt, anchor=5)
    a = plain.verify("s", len(prompt), TREE, want_node_probs=True)
    b = adapted.verify("s", len(prompt), TREE, want_node_probs=True, chains=MaskChains((0, 1, 2, 3, 4), 4))
    assert torch.equal(a.node_probs, b.node_probs)  # every real row's distribution, bitwise
    assert torch.equal(a.delta.features, b.delta.features)
    assert (a.accepted, a.bonus) == (b.accepted, b.bonus)
    assert a.delta.next_block is None and b.delta.next_block is not None
    assert b.delta.next_block.depth == 4
    # and the session's KV holds only the accepted path: the next rounds agree too
    for _ in range(3):
        a = plain.step("s", a.base, a.bonus)
        b = adapted.step("s", b.base, b.bonus)
        assert (a.bonus, a.base) == (b.bonus, b.base)


def test_adapter_off_is_the_base_model(target):
    """No chains: the verifier with an adapter is the verifier without one, bitwise."""
    adapter = random_adapter(target)
    plain, adapted = verifier_for(target), verifier_for(target, adapter)
    prompt = [0, 2, 4, 6]
    for v in (plain, adapted):
        prefill_at_anchor(v, "s", prompt, anchor=5)
    a = plain.verify("s", len(prompt), TREE, want_node_probs=True)
    b = adapted.verify("s", len(prompt), TREE, want_node_probs=True)
    assert torch.equal(a.node_probs, b.node_probs) and torch.equal(a.delta.features, b.delta.features)


def test_serving_mask_rows_are_the_training_arithmetic(target):
    """The chain the verifier drafts equals ``mask_chain_forward`` (what training optimizes)
    on the same context: fp32, within rounding."""
    adapter = random_adapter(target, block=3)
    v = verifier_for(target, adapter)
    prompt = [0, 7, 1, 9, 4, 11]
    anchor = 5
    prefill_at_anchor(v, "s", prompt, anchor)
    root = TokenTree.root_only(anchor)
    r = v.verify("s", len(prompt), root, chains=MaskChains((0,), 3, top_k=32))
    served = r.delta.next_block
    # training: the real tokens (prompt + anchor) through the target, a chain after the anchor
    ids = torch.tensor([[*prompt, anchor]])
    with torch.no_grad():
        _, kv = real_pass(target, ids)
        hidden = mask_chain_forward(target, adapter, kv, torch.tensor([[len(prompt)]]), 3)
        logp = torch.log_softmax(target.lm_head(hidden)[0].float(), -1)
    top = torch.topk(logp, 32, dim=-1)
    assert torch.equal(top.indices[:, :5], served.token_ids[:, :5])
    torch.testing.assert_close(top.values, served.log_probs, atol=1e-4, rtol=1e-4)


def self_engines(model, adapter, max_chains=None):
    verifier = verifier_for(model, adapter)
    drafter = SelfDrafter(adapter.config.block, model.config.vocab_size, (0, 2), max_chains=max_chains)
    return verifier, drafter


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    """An adapter trained on the tiny target's own greedy outputs: its drafts get accepted."""
    rng = random.Random(0)
    seqs = []
    for _ in range(60):
        prompt = [rng.randrange(32) for _ in range(rng.randint(3, 8))]
        seqs.append((tuple(prompt), tuple(hf_greedy(target, prompt, 40))))
    cfg = SelfTrainConfig(steps=60, block=4, rank=8, heldout_seqs=12, max_len=64, lr=3e-3, warmup=5,
                          log_every=20, ckpt_every=1000, out=str(tmp_path_factory.mktemp("self")))
    return SelfDraftAdapter.load(train_self_draft(cfg, target, seqs)), seqs


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget,depth,max_chains", [(1, 1, None), (4, 3, None), (16, 4, 3), (8, 4, 1)])
def test_greedy_equals_ar_in_self_mode(target, trained, method, budget, depth, max_chains):
    adapter, _ = trained
    verifier, drafter = self_engines(target, adapter, max_chains)
    accepted = 0
    for prompt in PROMPTS:
        tree = TreeParams(budget=budget, depth=depth)
        params = GenerationParams(method=method, tree=tree, max_new_tokens=24)
        res = generate(verifier, drafter, prompt, params)
        assert res.token_ids == hf_greedy(target, prompt, 24), (method, budget, depth, prompt)
        accepted += sum(r.accepted for r in res.rounds)
    assert accepted > 0  # the drafts were used, not just carried
    assert not verifier.sessions and not drafter.sessions


def test_greedy_equals_ar_in_self_mode_bf16(target, trained):
    adapter, _ = trained
    model = in_dtype(target, torch.bfloat16)
    ar_verifier = verifier_for(model)
    verifier, drafter = self_engines(model, adapter.to(torch.bfloat16))
    for prompt in PROMPTS:
        ar = generate(ar_verifier, None, prompt, GenerationParams(method="ar", max_new_tokens=24))
        for method in METHODS:
            params = GenerationParams(method=method, tree=TreeParams(budget=8, depth=4), max_new_tokens=24)
            res = generate(verifier, drafter, prompt, params)
            assert res.token_ids == ar.token_ids, (method, prompt)


def test_bad_chains_are_refused_and_change_nothing(target):
    prompt = [0, 3, 6]
    plain = verifier_for(target)
    prefill_at_anchor(plain, "s", prompt, 5)
    with pytest.raises(InvalidArgumentError, match="no self-draft adapter"):
        plain.verify("s", 3, TREE, chains=MaskChains((0,), 2))
    v = verifier_for(target, random_adapter(target, block=4))
    prefill_at_anchor(v, "s", prompt, 5)
    for chains, why in [(MaskChains((0,), 5), "depth = 5"), (MaskChains((0,), 0), "depth = 0"),
                        (MaskChains((7,), 2), "node 7"), (MaskChains((1, 1), 2), "named twice"),
                        (MaskChains((0,), 2, top_k=0), "top_k = 0")]:
        with pytest.raises(InvalidArgumentError, match=why):
            v.verify("s", 3, TREE, chains=chains)
        assert v.sessions["s"].base == 3 and v.sessions["s"].kv.length == 3  # nothing changed
    r = v.verify("s", 3, TREE, chains=MaskChains((0,), 2))  # and the session still works
    assert r.base >= 4


def test_chains_are_cut_at_the_context_window(target):
    from presto_sd.engine.verifier import VerifierLimits

    v = HFVerifier(target, (0, 2), VerifierLimits(max_context=12), adapter=random_adapter(target),
                   decoder="owned")
    prefill_at_anchor(v, "s", list(range(1, 9)), 5)  # base 8: positions 8..11 are left
    r = v.verify("s", 8, TokenTree.from_lists([5, 3], [-1, 0]), chains=MaskChains((0, 1), 4))
    nb = r.delta.next_block
    assert nb is None or nb.depth <= 2  # a chain after node 1 (position 9) has room for 2 rows


def test_adapter_files_round_trip_and_a_dir_without_weights_is_refused(target, tmp_path):
    adapter = random_adapter(target).float()
    adapter.save(tmp_path / "a")
    loaded = SelfDraftAdapter.load(tmp_path / "a")
    for k, v in adapter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16).float())  # stored in bf16
    from presto_sd.models.assets import write_digests

    write_digests(tmp_path / "a")
    config = tmp_path / "a" / CONFIG
    config.write_text(config.read_text().replace('"rank": 4', '"rank": 4 '))
    with pytest.raises(ValueError, match="self_draft.json missing or differing"):
        SelfDraftAdapter.load(tmp_path / "a")  # an edited file: refused
    (tmp_path / "a" / "adapter.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="adapter.safetensors"):
        SelfDraftAdapter.load(tmp_path / "a")  # no weights: refused, never a fresh adapter


def test_adapter_training_lowers_the_loss(target, trained):
    """The held-out chain loss of the trained adapter is below the fresh one's."""
    adapter, seqs = trained
    rng = random.Random(5)
    windows = [w for w in (window(s, 64, 4) for s in seqs[:12]) if w is not None]
    ids, hang = make_batch(windows, 8, 4, rng)
    fresh = SelfDraftAdapter.for_model(target, 4, rank=8)
    with torch.no_grad():
        before, _ = chain_loss(target, fresh, ids, hang, 4, 0.5, 4.0)
        after, _ = chain_loss(target, adapter, ids, hang, 4, 0.5, 4.0)
    assert float(after) < 0.9 * float(before)


def test_taps_prices_the_chains():
    fit = CostFit(intercept_s=0.01, per_node_s=0.001, per_context_s=0.0, per_node_context_s=0.0, tree_s=0.002)
    every = self_round_cost(fit, depth=4, max_chains=None)
    # a tree of n nodes carries 4n mask rows: n(1 + 4) rows, never a lone row
    for n in (1, 5, 9):
        assert every.seconds(n, 0) == pytest.approx(fit.seconds(5 * n, 0) if n > 1 else 0.01 + 0.002 + 0.005)
    capped = self_round_cost(fit, depth=4, max_chains=2)
    assert capped.seconds(9, 0) == pytest.approx(fit.seconds(9 + 8, 0))


def test_bench_and_replay_run_the_self_methods(target, trained):
    """``self-*`` rows beside the drafter's: lossless in the bench, and the replay's rounds
    (teacher-forced chains, training arithmetic) are the bench's."""
    from presto_sd.app.bench.replay import replay_bench
    from presto_sd.app.bench.runner import BenchConfig, BenchPrompt, run_bench
    from presto_sd.app.bench.stats import table_rows
    from tests.conftest import make_engines

    adapter, _ = trained
    verifier, drafter = make_engines(target)
    verifier = verifier_for(target, adapter)
    self_drafter = SelfDrafter(adapter.config.block, 32, (0, 2))
    prompts = [BenchPrompt("alpha", f"p{i}", tuple(p)) for i, p in enumerate(PROMPTS)]
    methods = ("ar", "linear", "self-linear", "self-marginal", "self-presto-best-first")
    params = GenerationParams(tree=TreeParams(depth=4), max_new_tokens=20)
    config = BenchConfig(methods, (4,), params, warmup=False)
    measured = run_bench(verifier, drafter, prompts, config, progress=False, self_drafter=self_drafter)
    rows = {(r["method"], r["budget"]): r for r in table_rows(measured, True) if r["dataset"] == "alpha"}
    assert all(rows[(m, b)]["ar_equal"] == 1.0 for m, b in rows)  # lossless, every row
    assert rows[("self-linear", None)]["tau"] > 1.2
    replayed, _ = replay_bench(verifier, drafter, prompts, config, progress=False, self_drafter=self_drafter)
    real = {(r.prompt_id, r.method, r.budget): r for r in measured}
    same = [[(x.accepted, x.tree_size) for x in r.rounds]
            == [(x.accepted, x.tree_size) for x in real[(r.prompt_id, r.method, r.budget)].rounds]
            for r in replayed if r.method.startswith("self-")]
    assert len(same) == 9 and all(same)


def test_the_mode_is_embedded_only(tmp_path):
    """Chains are not on the wire, and served engines refuse ``--drafter self``: each says why."""
    from presto_sd.embedded.stack import drafter_assets
    from presto_sd.engine.verifier import VerifyCall
    from verifier_service import wire

    with pytest.raises(InvalidArgumentError, match="not on the wire"):
        wire.verify_call_to_pb(VerifyCall("s", 3, TREE, chains=MaskChains((0,), 2)))
    assert wire.verify_call_to_pb(VerifyCall("s", 3, TREE)).tree  # without chains: as before
    (tmp_path / "a").mkdir()
    with pytest.raises(ValueError, match="runs embedded"):
        drafter_assets(None, f"self:{tmp_path / 'a'}")
    with pytest.raises(FileNotFoundError, match="no adapter dir"):
        drafter_assets(None, f"self:{tmp_path / 'missing'}")
