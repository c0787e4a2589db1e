"""The training pipeline end to end on a tiny target: gen-data -> drafter -> load -> decode."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from presto_sd.app.training.acceptance import AcceptanceConfig, train_acceptance
from presto_sd.app.training.gen_data import GenDataConfig, generate_training_data, load_shards
from presto_sd.app.training.train_drafter import TrainConfig, train_drafter
from presto_sd.embedded.stack import build_embedded
from presto_sd.loop.generate import GenerationParams, generate
from presto_sd.method.builders import TreeParams
from presto_sd.models.assets import PREFIX_HEAD_FILE
from presto_sd.models.dflash import DFlashDraftModel
from presto_sd.models.loading import DEFAULT_DRAFTER


def test_gen_data_and_drafter_training(tiny_target_dir, tmp_path):
    data = generate_training_data(GenDataConfig(
        out=str(tmp_path / "data"), target=str(tiny_target_dir), target_layer_ids=(0, 1),
        n_prompts=6, max_new_tokens=12, batch_size=3))
    seqs = load_shards(data)  # prompts over max_prompt_tokens (256) are skipped
    assert 4 <= len(seqs) <= 6 and all(s.features.shape == (len(s.tokens), 64) for s in seqs)
    # resumable: a second run finds every shard and writes nothing new
    before = sorted(p.stat().st_mtime_ns for p in data.glob("shard_*"))
    generate_training_data(GenDataConfig(out=str(data), target=str(tiny_target_dir),
                                         target_layer_ids=(0, 1), n_prompts=6, max_new_tokens=12,
                                         batch_size=3))
    assert sorted(p.stat().st_mtime_ns for p in data.glob("shard_*")) == before
    assert len({s.prompt_len for s in seqs}) > 1 and all(0 < s.prompt_len < len(s.tokens) for s in seqs)

    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), target=str(tiny_target_dir),
                      num_layers=1, block_size=4, draft_vocab=64, anchors_per_seq=4, batch_seqs=4,
                      steps=40, lr=3e-3, warmup=2, log_every=5, ckpt_every=20, heldout_seqs=1)
    drafter_dir = train_drafter(cfg)
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    first, last = log[0]["loss"], sum(r["loss"] for r in log[-2:]) / 2
    assert last < first, f"loss did not decrease: {first} -> {last}"

    model = DFlashDraftModel.load(drafter_dir)
    assert model.config.block_size == 4 and model.d2t is not None and len(model.d2t) <= 64
    assert model.prefix_head is None  # a drafter without the head: as published DFlash ones

    # acceptance predictors: traces -> h_phi, n-gram table, lambdas, calibration report
    report = train_acceptance(AcceptanceConfig(
        drafter=str(drafter_dir), data=str(data), target=str(tiny_target_dir), n_prompts=8,
        max_new_tokens=10, budget=8, depth=3, epochs=200, keep_traces=True))
    # the tiny drafter leaves little to learn: h_phi must at least match the constant
    # base-rate predictor on held-out traces (2 epochs left it at Brier 0.89 vs 0.002);
    # test_hphi_beats_the_base_rate_where_there_is_signal asks it to beat that constant
    base_rate = heldout_base_rate_brier(drafter_dir / "traces.pt", report["samples"]["heldout"])
    assert report["hphi"]["brier"] <= 1.1 * base_rate + 1e-3, (report["hphi"]["brier"], base_rate)
    for f in ("h_phi/h_phi.safetensors", "ngram.json.gz", "presto.json", "reliability.png"):
        assert (drafter_dir / f).exists(), f
    assert len(json.loads((drafter_dir / "presto.json").read_text())["lambdas"]) == 3

    # the trained checkpoint (with its PRESTO assets) drives lossless decoding of its target
    stack = build_embedded(str(tiny_target_dir), str(drafter_dir), device=torch.device("cpu"))
    prompt = [1, 2, 3, 4, 5]
    ar = generate(stack.verifier, None, prompt, GenerationParams(method="ar", max_new_tokens=12))
    assert set(stack.drafter.rho_providers) >= {"ngram", "hphi"}
    for method, rho in (("linear", "ngram"), ("presto-beam", "hphi"), ("presto-best-first", "ngram")):
        tree = TreeParams(budget=8, rho=rho, lambdas=stack.assets.defaults.lambdas)
        res = generate(stack.verifier, stack.drafter, prompt,
                       GenerationParams(method=method, tree=tree, max_new_tokens=12))
        assert res.token_ids == ar.token_ids


def heldout_base_rate_brier(traces_file, n_heldout: int) -> float:
    """Brier, on the held-out traces, of the constant predictor "the training acceptance rate".

    ``train_acceptance`` holds out the traces of its first prompts (``prompt < n_held``).
    """
    traces = torch.load(traces_file)
    order = torch.argsort(traces["prompt"], stable=True)
    held, train = traces["label"][order[:n_heldout]], traces["label"][order[n_heldout:]]
    return float(((train.mean() - held) ** 2).mean())


def test_gen_data_resumed_equals_uninterrupted(tiny_target_dir, tmp_path):
    """A job stopped after its first shard (and mid-way through its second: a stray .tmp)
    restarts where it stopped and writes exactly the shards an uninterrupted run writes."""
    cfg = dict(target=str(tiny_target_dir), target_layer_ids=(0, 1), sources="code,arith", n_code=5,
               n_arith=5, max_new_tokens=10, batch_size=4, temperature=0.8)
    whole = generate_training_data(GenDataConfig(out=str(tmp_path / "whole"), **cfg))
    parts = tmp_path / "parts"
    generate_training_data(GenDataConfig(out=str(parts), max_batches=1, **cfg))
    assert len(list(parts.glob("shard_*.safetensors"))) == 1
    (parts / "shard_00001.tmp").write_bytes(b"half a shard")
    generate_training_data(GenDataConfig(out=str(parts), **cfg))
    names = sorted(p.name for p in whole.glob("shard_*.safetensors"))
    assert len(names) == 3 and names == sorted(p.name for p in parts.glob("shard_*.safetensors"))
    for name in names:
        assert (whole / name).read_bytes() == (parts / name).read_bytes(), name
    with pytest.raises(ValueError, match="another plan"):  # other flags over these shards
        generate_training_data(GenDataConfig(out=str(parts), **{**cfg, "n_arith": 6}))
    rows = [json.loads(line) for line in (whole / "progress.jsonl").read_text().splitlines()]
    assert [r["shard"] for r in rows] == [0, 1, 2] and all(r["new_tokens"] > 0 for r in rows)


def test_prefix_head_trains_and_drives_trees(tiny_target_dir, tmp_path):
    """The prefix-conditioned head trains jointly (its conditional loss falls), is saved in
    the checkpoint, and is the ``prefix`` rho provider of lossless tree decoding."""
    data = generate_training_data(GenDataConfig(
        out=str(tmp_path / "data"), target=str(tiny_target_dir), target_layer_ids=(0, 1),
        sources="arith", n_arith=8, max_new_tokens=16, batch_size=4))
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), target=str(tiny_target_dir),
                      num_layers=1, block_size=4, draft_vocab=64, anchors_per_seq=4, batch_seqs=4,
                      steps=40, lr=3e-3, warmup=2, log_every=5, ckpt_every=40, heldout_seqs=1,
                      prefix_rank=8)
    drafter_dir = train_drafter(cfg)
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert sum(r["loss"] for r in log[-2:]) / 2 < log[0]["loss"]
    assert "acc_cond" in log[-1]
    model = DFlashDraftModel.load(drafter_dir)
    assert model.config.prefix_head_rank == 8 and model.prefix_head is not None
    assert model.prefix_head.next.abs().sum() > 0  # it learnt something

    # a head alone on a frozen drafter: the drafter's weights do not move
    frozen = train_drafter(TrainConfig(
        data=str(data), out=str(tmp_path / "head-only"), target=str(tiny_target_dir), draft_vocab=64,
        anchors_per_seq=4, batch_seqs=4, steps=5, warmup=1, ckpt_every=5, heldout_seqs=1,
        prefix_rank=4, init_drafter=str(drafter_dir), prefix_only=True))
    again = DFlashDraftModel.load(frozen)
    assert again.config.prefix_head_rank == 4 and torch.equal(again.fc.weight, model.fc.weight)
    assert torch.equal(again.d2t, model.d2t)
    # the head ships in its own file: the drafter's weights file is the base's, byte for byte
    assert (frozen / "model.safetensors").read_bytes() == (drafter_dir / "model.safetensors").read_bytes()
    assert (frozen / PREFIX_HEAD_FILE).read_bytes() != (drafter_dir / PREFIX_HEAD_FILE).read_bytes()

    stack = build_embedded(str(tiny_target_dir), str(drafter_dir), device=torch.device("cpu"))
    assert {"prefix", "prefix-ngram", "prefix-lookup"} <= set(stack.drafter.rho_providers)
    prompt = [1, 2, 3, 4, 5]
    ar = generate(stack.verifier, None, prompt, GenerationParams(method="ar", max_new_tokens=12))
    from presto_sd.app.bench.replay import position_stats, record

    stats = position_stats(stack.drafter, [record(stack.verifier, prompt, 16)], 8, top_k=4,
                           progress=False).summary()
    cond = stats["prefix_recall"]
    assert len(cond["1"]) == 3 and all(0 <= a <= b <= 1 for a, b in zip(cond["1"], cond["4"]))
    for method, rho in itertools.product(("presto-beam", "presto-best-first", "taps"),
                                         ("prefix", "prefix-ngram", "prefix-lookup")):
        tree = TreeParams(budget=6, rho=rho, lambdas=(1.0,))
        res = generate(stack.verifier, stack.drafter, prompt,
                       GenerationParams(method=method, tree=tree, max_new_tokens=12))
        assert res.token_ids == ar.token_ids, (method, rho)


def test_warm_start_with_a_new_token_map(tiny_target_dir, tmp_path):
    """``revocab`` keeps a drafter's weights and gives it a new map of the training data's
    most frequent tokens (the head is the target's rows); ``bf16`` autocast trains too."""
    data = generate_training_data(GenDataConfig(
        out=str(tmp_path / "data"), target=str(tiny_target_dir), target_layer_ids=(0, 1),
        sources="arith", n_arith=8, max_new_tokens=16, batch_size=4))
    common = dict(data=str(data), target=str(tiny_target_dir), num_layers=1, block_size=4,
                  anchors_per_seq=4, batch_seqs=4, warmup=1, heldout_seqs=1)
    base = train_drafter(TrainConfig(out=str(tmp_path / "base"), draft_vocab=64, steps=30,
                                     lr=3e-3, log_every=5, ckpt_every=30, bf16=True, **common))
    log = [json.loads(line) for line in (tmp_path / "base" / "train_log.jsonl").read_text().splitlines()]
    assert sum(r["loss"] for r in log[-2:]) / 2 < log[0]["loss"]
    # lr 0: the step changes nothing, so what comes out is the warm start itself
    remapped = train_drafter(TrainConfig(out=str(tmp_path / "remap"), draft_vocab=32, steps=1, lr=0.0,
                                         ckpt_every=1, init_drafter=str(base), revocab=True, **common))
    before, after = DFlashDraftModel.load(base), DFlashDraftModel.load(remapped)
    assert len(before.d2t) == 64 and len(after.d2t) == 32 and after.config.draft_vocab_size == 32
    assert set(after.d2t.tolist()) <= set(before.d2t.tolist())  # the 32 most frequent of the same data
    assert all(torch.equal(v, after.state_dict()[k]) for k, v in before.state_dict().items())
    with pytest.raises(ValueError, match="revocab"):  # nothing to re-map
        train_drafter(TrainConfig(out=str(tmp_path / "none"), revocab=True, steps=1, **common))


def test_grown_drafter_starts_as_its_parent(tiny_target_dir, tmp_path):
    """``grow_layers`` appends layers whose output projections start at zero: the grown
    drafter's states equal its parent's before a step (lr 0), and the new layers learn."""
    data = generate_training_data(GenDataConfig(
        out=str(tmp_path / "data"), target=str(tiny_target_dir), target_layer_ids=(0, 1),
        sources="arith", n_arith=8, max_new_tokens=16, batch_size=4))
    common = dict(data=str(data), target=str(tiny_target_dir), num_layers=1, block_size=4,
                  anchors_per_seq=4, batch_seqs=4, warmup=1, heldout_seqs=1, draft_vocab=64)
    base = train_drafter(TrainConfig(out=str(tmp_path / "base"), steps=5, lr=3e-3, ckpt_every=5, **common))
    grown = train_drafter(TrainConfig(out=str(tmp_path / "grown"), steps=1, lr=0.0, ckpt_every=1,
                                      init_drafter=str(base), grow_layers=1, **common))
    parent, child = DFlashDraftModel.load(base), DFlashDraftModel.load(grown)
    assert child.config.num_hidden_layers == parent.config.num_hidden_layers + 1
    torch.manual_seed(0)
    feats = torch.randn(1, 6, child.fc.in_features)
    block = torch.randn(1, 4, child.config.hidden_size)
    ctx_pos, pos = torch.arange(6)[None], torch.arange(6, 10)[None]
    with torch.no_grad():
        want = parent(block, pos, parent.context_kv(feats, ctx_pos))
        got = child(block, pos, child.context_kv(feats, ctx_pos))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    learned = train_drafter(TrainConfig(out=str(tmp_path / "learned"), steps=3, lr=3e-3, ckpt_every=3,
                                        init_drafter=str(base), grow_layers=1, **common))
    new_layer = DFlashDraftModel.load(learned).layers[-1]
    assert new_layer.self_attn.o_proj.weight.abs().sum() > 0
    with pytest.raises(ValueError, match="grow_layers"):  # nothing to grow
        train_drafter(TrainConfig(out=str(tmp_path / "none"), grow_layers=1, steps=1,
                                  **common))


def test_shipped_drafter_matches_the_target(smollm2_dir):
    if not (DEFAULT_DRAFTER / "config.json").exists():
        pytest.skip("no drafter shipped yet")
    model = DFlashDraftModel.load(DEFAULT_DRAFTER)
    target = json.loads((smollm2_dir / "config.json").read_text())
    c = model.config
    assert c.hidden_size == target["hidden_size"] and c.vocab_size == target["vocab_size"]
    assert max(c.target_layer_ids) < target["num_hidden_layers"]
    assert c.num_target_layers == target["num_hidden_layers"]


def synthetic_traces(n: int, seed: int, hidden: int = 8, vocab: int = 32):
    """Traces whose acceptance follows ``log q`` and the drafter state: something to learn."""
    from presto_sd.app.training.acceptance import Traces

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    log_q = -6 * torch.rand(n, generator=g)
    p = torch.sigmoid(1.5 * log_q + 4 + 2 * h[:, 0])
    label = (torch.rand(n, generator=g) < p).float()
    zeros = torch.zeros(n)
    return Traces(hidden=h, parent=torch.randint(0, vocab, (n,), generator=g),
                  token=torch.randint(0, vocab, (n,), generator=g), log_q=log_q,
                  entropy=torch.rand(n, generator=g), depth=torch.randint(1, 8, (n,), generator=g),
                  log_rho_ngram=log_q + torch.randn(n, generator=g), log_rho_prefix=zeros, p_target=p,
                  label=label, group=torch.arange(n), prompt=torch.arange(n) // 50)


def test_hphi_beats_the_base_rate_where_there_is_signal():
    """The Brier score of the trained h_phi on held-out traces is well below that of the
    constant predictor (the training acceptance rate); an untrained h_phi is not."""
    from presto_sd.app.training.acceptance import calibration, features_of, train_hphi
    from presto_sd.method.scores import HPhi

    traces = synthetic_traces(6000, seed=0)
    held_mask = traces.prompt < 30  # the first prompts, as train_acceptance holds them out
    train, held = traces.select(~held_mask), traces.select(held_mask)
    embed = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    base_rate = float(((train.label.mean() - held.label) ** 2).mean())

    def heldout_brier(model) -> float:
        with torch.no_grad():
            return calibration(torch.sigmoid(model(features_of(held, embed))), held.label)["brier"]

    trained = heldout_brier(train_hphi(train, embed, epochs=30, seed=0))
    assert trained < 0.8 * base_rate, (trained, base_rate)
    torch.manual_seed(0)
    untrained = heldout_brier(HPhi(hidden_size=8, embed_size=4, n_scalars=4).eval())
    assert untrained >= 0.8 * base_rate, (untrained, base_rate)  # the check can fail
