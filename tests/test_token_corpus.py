"""The repo corpus: id shards, resuming from committed shards, features and soft labels by prefill."""

from __future__ import annotations

import json
import lzma
import random
import shutil

import pytest
import torch

from presto_sd.app.training.features import materialize, prefill_sequences
from presto_sd.app.training.gen_data import GenDataConfig, generate_training_data, load_shards
from presto_sd.app.training.grow_corpus import GrowConfig, grow_corpus
from presto_sd.app.training.token_corpus import Corpus, CorpusError, IdShard, decode_shard, encode_shard
from presto_sd.app.training.train_drafter import DraftVocab, TrainConfig, make_batch, soft_kl, train_drafter
from presto_sd.models.loading import load_target

SHARD = IdShard(("a/0", "b/1"), ((1, 2, 3), (4,)), ((5, 6), (7, 8, 9, 49151)))


def test_a_shard_round_trips_and_its_bytes_are_a_function_of_its_content():
    data = encode_shard(SHARD)
    assert decode_shard(data) == SHARD
    assert encode_shard(decode_shard(data)) == data  # no timestamps: a resumed job can be compared
    assert SHARD.n_tokens == 10 and SHARD.n_response_tokens == 6


def test_malformed_shards_are_named_errors():
    with pytest.raises(CorpusError, match="uint16"):
        encode_shard(IdShard(("x",), ((70000,),), ((1,),)))
    with pytest.raises(ValueError, match="one prompt and one response") as bug:  # a writer's bug
        IdShard(("x", "y"), ((1,),), ((1,),))
    assert not isinstance(bug.value, CorpusError)  # so it keeps its traceback
    with pytest.raises(CorpusError, match="not an xz shard"):
        decode_shard(b"not xz")
    with pytest.raises(CorpusError, match="bad magic"):
        decode_shard(lzma.compress(b"something else\n{}\n"))


def test_an_edited_shard_or_another_plan_is_refused(tmp_path):
    corpus = Corpus(tmp_path / "c")
    corpus.open_plan({"seed": 0}, "tok")
    entry = corpus.write(0, SHARD, {"dtype": "float32"})
    assert corpus.read(0) == SHARD and entry["sequences"] == 2 and entry["tokens"] == 10
    assert corpus.manifest()["totals"] == {"shards": 1, "sequences": 2, "tokens": 10, "response_tokens": 6,
                                           "bytes": entry["bytes"]}
    with pytest.raises(CorpusError, match="another plan .*seed"):
        corpus.open_plan({"seed": 1}, "tok")
    corpus.open_plan({"seed": 0}, "tok")  # the same plan resumes
    path = corpus.shard_path(0)
    path.write_bytes(encode_shard(IdShard(("a/0",), ((1,),), ((2,),))))
    with pytest.raises(CorpusError, match="sha256"):
        corpus.read(0)


GROW = dict(sources="code,arith", n_code=5, n_arith=5, max_new_tokens=10, batch_size=4, dtype="float32")


def test_resuming_from_committed_shards_on_an_empty_cache_writes_the_same_shards(
        tiny_target_dir, tmp_path, monkeypatch):
    """A fresh machine has the repo's shards and nothing else: it rebuilds the plan, checks
    the shards against it and writes the rest exactly as an uninterrupted run does."""
    model, tok = load_target(str(tiny_target_dir), torch.device("cpu"), torch.float32)
    monkeypatch.setenv("PRESTO_SD_CACHE", str(tmp_path / "cache-a"))
    whole = grow_corpus(GrowConfig(corpus=str(tmp_path / "whole"), target=str(tiny_target_dir), **GROW),
                        model, tok)
    monkeypatch.setenv("PRESTO_SD_CACHE", str(tmp_path / "cache-b"))
    parts = tmp_path / "parts"
    grow_corpus(GrowConfig(corpus=str(parts), target=str(tiny_target_dir), max_shards=1, **GROW), model, tok)
    assert Corpus(parts).indices() == [0]
    shutil.rmtree(tmp_path / "cache-b")  # the machine changes: only the committed shards remain
    monkeypatch.setenv("PRESTO_SD_CACHE", str(tmp_path / "cache-c"))
    grow_corpus(GrowConfig(corpus=str(parts), target=str(tiny_target_dir), **GROW), model, tok)
    names = sorted(p.name for p in whole.glob("shard_*"))
    assert len(names) == 3 and names == sorted(p.name for p in parts.glob("shard_*"))
    for name in names:
        assert (whole / name).read_bytes() == (parts / name).read_bytes(), name
    a, b = Corpus(whole).manifest(), Corpus(parts).manifest()
    assert a["totals"] == b["totals"] and a["plan_key"] == b["plan_key"]
    assert all(e["cpu"] and e["dtype"] == "float32" and e["command"] for e in b["shards"].values())
    with pytest.raises(CorpusError, match="another plan"):
        grow_corpus(GrowConfig(corpus=str(parts), target=str(tiny_target_dir), **{**GROW, "n_arith": 6}),
                    model, tok)

    # a shard whose prompts the plan no longer makes (a prompt built from a default's repr with
    # its memory address did this once) is refused, and --drop-stale regenerates it exactly
    corpus = Corpus(parts)
    real = corpus.read(1)
    corpus.write(1, IdShard(real.item_ids, ((*real.prompts[0], 42), *real.prompts[1:]), real.responses),
                 {"command": "edited"})
    cfg = GrowConfig(corpus=str(parts), target=str(tiny_target_dir), **GROW)
    with pytest.raises(CorpusError, match=r"shards \[1\] .* other prompts"):
        grow_corpus(cfg, model, tok)
    grow_corpus(GrowConfig(**{**cfg.__dict__, "drop_stale": True}), model, tok)
    assert (whole / "shard_00001.ids.xz").read_bytes() == (parts / "shard_00001.ids.xz").read_bytes()
    assert Corpus(whole).manifest()["totals"] == Corpus(parts).manifest()["totals"]


def test_the_feature_prefill_equals_the_features_generation_captured(tiny_target_dir, tmp_path):
    """fp32: the prefill's rows equal the incremental decode's to rounding (other matmul
    shapes sum in another order); the last row, never fed in generation, is a real one here."""
    layers = (0, 1)
    data = generate_training_data(GenDataConfig(
        out=str(tmp_path / "data"), target=str(tiny_target_dir), target_layer_ids=layers,
        sources="code,arith", n_code=3, n_arith=3, max_new_tokens=12, batch_size=3))
    model, _ = load_target(str(tiny_target_dir), torch.device("cpu"), torch.float32)
    seqs = load_shards(data)
    feats, top_ids, top_lp = prefill_sequences(model, [s.tokens.tolist() for s in seqs], layers,
                                               top_k=4, max_batch_tokens=64)
    for s, f, ti, lp in zip(seqs, feats, top_ids, top_lp):
        captured = s.features.float()[:-1]
        torch.testing.assert_close(f.float()[:-1], captured, atol=2e-2, rtol=1e-2)  # both stored in bf16
        assert f[-1].abs().sum() > 0 and ti.shape == (len(s.tokens), 4) and (lp[:, :-1] >= lp[:, 1:]).all()
        logits = model(input_ids=s.tokens[None]).logits[0]
        assert torch.equal(ti[:, 0].long(), logits.argmax(-1))  # row t: the target's next-token choice


def test_soft_kl_is_the_hard_ce_for_a_one_hot_target_and_drops_mass_outside_the_vocab():
    torch.manual_seed(0)
    logits = torch.randn(1, 1, 2, 5)
    weights = torch.ones(2)
    ids = torch.tensor([[[[3, -100], [1, 2]]]])
    lp = torch.tensor([[[[0.0, -torch.inf], [-0.1, -2.3]]]])
    got = soft_kl(logits, ids, lp, weights)
    p = torch.softmax(torch.tensor([-0.1, -2.3]), 0)
    want = (-torch.log_softmax(logits[0, 0, 0], -1)[3]  # one-hot: KL is the CE
            + (p * (p.log() - torch.log_softmax(logits[0, 0, 1], -1)[[1, 2]])).sum()) / 2
    torch.testing.assert_close(got, want)
    none = soft_kl(logits, torch.full_like(ids, -100), torch.full_like(lp, -torch.inf), weights)
    assert none.item() == 0.0  # no label anywhere: no loss, not NaN


def test_a_drafter_trains_on_the_corpus_with_soft_labels(tiny_target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PRESTO_SD_CACHE", str(tmp_path / "cache"))
    model, tok = load_target(str(tiny_target_dir), torch.device("cpu"), torch.float32)
    corpus = grow_corpus(GrowConfig(corpus=str(tmp_path / "corpus"), target=str(tiny_target_dir),
                                    **{**GROW, "max_new_tokens": 24}), model, tok)
    data = materialize(corpus, tmp_path / "data", model, str(tiny_target_dir), (0, 1), top_k=8)
    meta = json.loads((data / "meta.json").read_text())
    assert meta["shards"] == 3 and meta["prefilled_tokens"] > 0 and meta["prefill_tokens_per_s"] > 0
    again = materialize(corpus, tmp_path / "data2", model, str(tiny_target_dir), (0, 1), top_k=8)
    assert json.loads((again / "meta.json").read_text())["prefilled_tokens"] == 0  # a cache hit
    for window, why in (({"first_shard": 3}, "no corpus shards from shard 3 .*lists 3"),
                        ({"corpus_dir": tmp_path / "typo"}, r"typo: not a corpus \(no manifest.json\)")):
        with pytest.raises(CorpusError, match=why):  # not an empty data dir that trains on nothing
            materialize(**{"corpus_dir": corpus, **window}, out=tmp_path / "none", model=model,
                        target=str(tiny_target_dir), layer_ids=(0, 1), top_k=8)
    assert not (tmp_path / "none").exists()
    seqs = load_shards(data)
    assert all(s.soft_labels[0].shape == (len(s.tokens), 8) for s in seqs)
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), target=str(tiny_target_dir),
                      num_layers=1, block_size=4, draft_vocab=64, anchors_per_seq=4, batch_seqs=4,
                      steps=100, lr=1e-2, warmup=2, log_every=10, ckpt_every=100, heldout_seqs=1,
                      soft_weight=0.5)
    drafter_dir = train_drafter(cfg)
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    # a random tiny target and 12 sequences: the KL falls ~13 % in 100 steps (3.93 -> 3.42)
    first, last = sum(r["soft_kl"] for r in log[:2]) / 2, sum(r["soft_kl"] for r in log[-3:]) / 3
    assert last < 0.95 * first, f"the drafter did not move towards the target: {first} -> {last}"
    report = json.loads((drafter_dir / "training_report.json").read_text())
    assert 0.0 <= report["oov_label_rate"] < 1.0
    plain = generate_training_data(GenDataConfig(  # shards without soft labels refuse soft training
        out=str(tmp_path / "plain"), target=str(tiny_target_dir), target_layer_ids=(0, 1),
        sources="arith", n_arith=2, max_new_tokens=6, batch_size=2))
    with pytest.raises(ValueError, match="soft labels"):
        make_batch(load_shards(plain), cfg, DraftVocab(torch.arange(64), 49152).t2d, random.Random(0))


def test_acceptance_traces_take_held_out_prompts_from_the_corpus(tmp_path):
    from presto_sd.app.training.acceptance import corpus_prompts

    corpus = Corpus(tmp_path / "c")
    corpus.open_plan({"seed": 0}, "tok")
    for i in range(3):
        prompts = tuple((10 * i + j, 1) for j in range(4))
        corpus.write(i, IdShard(tuple(f"s{i}/{j}" for j in range(4)), prompts, ((5,),) * 4), {})
    got = corpus_prompts(tmp_path / "c", 1, 4)  # shards 1 and 2: the ones a drafter of shard 0 never saw
    assert got == [[10, 1], [12, 1], [20, 1], [22, 1]]
    with pytest.raises(ValueError, match="from index 3"):
        corpus_prompts(tmp_path / "c", 3, 4)
    with pytest.raises(ValueError, match="9 asked"):
        corpus_prompts(tmp_path / "c", 1, 9)
