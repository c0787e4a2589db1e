"""Prefill-only data: the written-answers corpus, a feature dir of one source, target labels."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from presto_sd.app.training import written
from presto_sd.app.training.corpus import item_source
from presto_sd.app.training.features import materialize
from presto_sd.app.training.gen_data import load_shards
from presto_sd.app.training.grow_corpus import GrowConfig, grow_corpus
from presto_sd.app.training.token_corpus import Corpus, CorpusError, IdShard
from presto_sd.app.training.train_drafter import (
    DraftVocab,
    TrainConfig,
    build_draft_vocab,
    make_batch,
    read_data,
    train_drafter,
)
from presto_sd.app.training.written import WrittenConfig, write_written_corpus, written_shard
from presto_sd.models.loading import load_target


def test_item_sources_follow_the_plans_ids():
    assert [item_source(i) for i in ("code/12", "arith/7", "GAlxmQy_0/1")] == ["code", "arith", "sharegpt"]


def test_a_written_shard_keeps_the_answered_items_ended_and_cut_as_generation_cuts():
    shard = IdShard(("c/1", "code/3", "c/5"), ((1, 2), (3,), (4,)), ((9, 2), (8, 2), (7,)))
    answers = {"c/1": "ab", "c/5": "abcdef"}
    got = written_shard(shard, answers, lambda text: [ord(ch) for ch in text], eos_id=2, max_new_tokens=4)
    assert got.item_ids == ("c/1", "c/5") and got.prompts == ((1, 2), (4,))
    assert got.responses == ((97, 98, 2), (97, 98, 99, 100))  # the long answer cut, with no end token


def test_code_items_asking_for_a_function_are_answered_by_its_own_source():
    from presto_sd.app.training.corpus import CODE_WRITTEN_TEMPLATES, code_draws

    draws = code_draws(12, seed=0)
    answers = written.code_answers(12, seed=0)
    asking = {f"code/{i}" for i, (_, t) in enumerate(draws) if t in CODE_WRITTEN_TEMPLATES}
    assert answers and set(answers) <= asking
    for item, text in answers.items():
        (module, name, _, _), _ = draws[int(item.split("/")[1])]
        assert text.startswith("```python\n") and text.endswith("\n```") and f"def {name}(" in text


def test_a_written_answer_quoting_a_benchmark_prompt_is_dropped(monkeypatch):
    from presto_sd.app.training import corpus

    quoted = "Natalia sold clips to forty eight of her friends in April and then half as many in May"
    monkeypatch.setattr(corpus, "benchmark_ngrams", lambda: corpus._ngrams(quoted, 13))
    answers = {"a/1": f"You asked: {quoted}. So 72.", "b/1": "A different answer of many ordinary words " * 3}
    assert written.decontaminated(answers) == {"b/1": answers["b/1"]}


def test_the_written_corpus_mirrors_the_shards_resumes_and_refuses_another_corpus(
        tiny_target_dir, tmp_path, monkeypatch):
    src = Corpus(tmp_path / "regen")
    src.open_plan({"max_new_tokens": 3, "seed": 0}, "tok")
    for i in range(3):
        src.write(i, IdShard((f"conv{i}/1", f"code/{i}"), ((1, 2), (3,)), ((4, 2), (5, 2))), {})
    answers = {f"conv{i}/1": "Hello there, friend" for i in range(3)}
    monkeypatch.setattr(written, "sharegpt_answers", lambda split: answers)
    cfg = WrittenConfig(out=str(tmp_path / "written"), first_shard=1, corpus=str(src.root),
                        target=str(tiny_target_dir))
    out = Corpus(write_written_corpus(cfg))
    assert out.indices() == [1, 2]
    shard = out.read(1)
    assert shard.item_ids == ("conv1/1",) and shard.prompts == ((1, 2),) and len(shard.responses[0]) == 3
    before = out.shard_path(1).stat().st_mtime_ns
    write_written_corpus(cfg)  # resumed: the shards there are kept
    assert out.shard_path(1).stat().st_mtime_ns == before
    other = Corpus(tmp_path / "other")
    other.open_plan({"max_new_tokens": 3, "seed": 1}, "tok")
    other.write(1, IdShard(("conv1/1",), ((1,),), ((2,),)), {})
    with pytest.raises(CorpusError, match="another plan"):
        write_written_corpus(WrittenConfig(out=str(tmp_path / "written"), corpus=str(other.root),
                                           target=str(tiny_target_dir)))
    with pytest.raises(ValueError, match="written answers come from"):
        write_written_corpus(WrittenConfig(out=str(tmp_path / "w3"), corpus=str(src.root),
                                           sources="sharegpt,tests"))
    with pytest.raises(CorpusError, match="no shard from 9"):
        write_written_corpus(WrittenConfig(out=str(tmp_path / "w2"), first_shard=9, corpus=str(src.root),
                                           target=str(tiny_target_dir)))


def test_a_feature_dir_of_one_source_and_target_labels(tiny_target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PRESTO_SD_CACHE", str(tmp_path / "cache"))
    model, tok = load_target(str(tiny_target_dir), torch.device("cpu"), torch.float32)
    corpus = grow_corpus(GrowConfig(corpus=str(tmp_path / "corpus"), target=str(tiny_target_dir),
                                    sources="code,arith", n_code=4, n_arith=4, max_new_tokens=10,
                                    batch_size=4, dtype="float32"), model, tok)
    everything = materialize(corpus, tmp_path / "all", model, None, (0, 1), top_k=4)
    full = load_shards(everything)
    arith = materialize(corpus, tmp_path / "arith", model, None, (0, 1), top_k=4, sources=("arith",))
    kept = load_shards(arith)
    copy = next(arith.glob("shard_*.safetensors"))
    made = copy.stat().st_mtime_ns
    materialize(corpus, arith, model, None, (0, 1), top_k=4, sources=("arith",))
    assert copy.stat().st_mtime_ns == made  # the copy is kept, not rewritten on every call
    materialize(corpus, arith, model, None, (0, 1), top_k=4, sources=("code",))
    assert copy.stat().st_mtime_ns != made and len(load_shards(arith)) == 4  # other sources: new copies
    materialize(corpus, arith, model, None, (0, 1), top_k=4, sources=("arith",))
    kept = load_shards(arith)
    ids = [i for k in Corpus(corpus).indices() for i in Corpus(corpus).read(k).item_ids]
    want = [s for s, i in zip(full, ids) if i.startswith("arith/")]
    assert len(kept) == len(want) == 4
    for s, w in zip(kept, want):  # the same rows, copied out of the cached shard
        assert torch.equal(s.tokens, w.tokens) and s.prompt_len == w.prompt_len
        assert torch.equal(s.features, w.features) and torch.equal(s.soft_labels[0], w.soft_labels[0])

    meta, both = read_data(f"{everything},{arith}")  # several dirs train one drafter
    assert meta["sources"] == "all" and len(both) == len(full) + len(kept)
    other_layers = materialize(corpus, tmp_path / "layer0", model, None, (0,), top_k=4)
    with pytest.raises(ValueError, match="target layers"):
        read_data(f"{arith},{other_layers}")

    # answers someone else wrote: here every token shifted, so they are never the target's choice
    other = [replace(s, tokens=(s.tokens + 1) % 49152) for s in kept[:2]]
    t2d = DraftVocab(torch.arange(49152), 49152).t2d
    base = dict(data=str(arith), out=str(tmp_path / "run"), target=str(tiny_target_dir), num_layers=1,
                block_size=4, draft_vocab=0, anchors_per_seq=2, batch_seqs=2)
    by_tokens = make_batch(other, TrainConfig(**base), t2d, random.Random(0))
    by_target = make_batch(other, TrainConfig(**base, hard_labels="target"), t2d, random.Random(0))
    block_ids, labels, labels_t = by_tokens[2], by_tokens[5], by_target[5]
    assert torch.equal(block_ids, by_target[2])  # the same anchors: only the labels differ
    assert not torch.equal(labels, labels_t)
    for b, s in enumerate(other):
        top1 = s.soft_labels[0][:, 0].long()
        for j in range(2):
            a = int(by_tokens[3][b, j * 4])  # the anchor's position
            n = min(3, len(s.tokens) - a - 1)
            assert torch.equal(labels[b, j, :n], s.tokens[a + 1 : a + 1 + n])
            assert torch.equal(labels_t[b, j, :n], top1[a : a + n])  # row t predicts token t + 1
    with pytest.raises(ValueError, match="--hard-labels 'mine'"):
        train_drafter(TrainConfig(**base, hard_labels="mine"))

    # the draft map holds what the CE will ask for: the target's labels, not the written tokens
    target_labels = {t for s in other
                     for t in s.soft_labels[0][s.prompt_len - 1 : len(s.tokens) - 1, 0].tolist()}
    written_tokens = {t for s in other for t in s.tokens[s.prompt_len :].tolist()}
    assert not written_tokens <= target_labels
    size = len(target_labels | written_tokens) + 1  # room for every label and eos
    assert set(build_draft_vocab(other, len(target_labels) + 1, 49152, [2], "target").tolist()) \
        == target_labels | {2}
    assert set(build_draft_vocab(other, size, 49152, [2]).tolist()) == written_tokens | {2}


def test_arithmetic_worked_solutions_are_right_step_by_step_and_leave_the_plan_unchanged():
    import hashlib
    import json
    import re

    from presto_sd.app.training.corpus import arithmetic_items, arithmetic_solutions

    items = arithmetic_items(6000, seed=0)
    # the committed corpus was generated from these prompts: adding solutions must not move them
    digest = hashlib.sha256(json.dumps([(it.id, it.messages) for it in items]).encode()).hexdigest()
    assert digest == "f484e42430b22eb1d5b0bafb2aca62b2a4f23de8ea99dd4c0b507be751c73471"
    solutions = arithmetic_solutions(6000, seed=0)
    assert set(solutions) == {it.id for it in items}
    ops = {"×": "*", "÷": "/", "+": "+", "−": "-"}
    equation = re.compile(r"(\d+(?:\.\d+)?(?: [×÷+−] \d+(?:\.\d+)?)+) = \$?(\d+(?:\.\d+)?)")
    checked = answered = 0
    for text in solutions.values():
        answered += "**Answer: " in text
        for lhs, rhs in equation.findall(text):
            value = eval("".join(ops.get(ch, ch) for ch in lhs.replace(" ", "")))  # digits and + - * / only
            assert abs(value - float(rhs)) <= 0.03, (lhs, rhs, text)  # a part is rounded to cents
            checked += 1
    assert checked > 15_000 and answered > 5_500  # the rest say which numbers do not fit


def test_the_written_corpus_answers_arithmetic_only_when_asked(tiny_target_dir, tmp_path):
    from presto_sd.app.training.corpus import arithmetic_solutions

    src = Corpus(tmp_path / "regen")
    src.open_plan({"max_new_tokens": 400, "seed": 0, "n_arith": 4, "sources": "arith"}, "tok")
    src.write(0, IdShard(("arith/1", "arith/3"), ((1, 2), (3,)), ((4, 2), (5, 2))), {})
    base = dict(corpus=str(src.root), target=str(tiny_target_dir))
    assert not Corpus(write_written_corpus(WrittenConfig(out=str(tmp_path / "w"), **base))).indices() or \
        not Corpus(tmp_path / "w").read(0).item_ids  # by default arithmetic has no written answer
    out = Corpus(write_written_corpus(WrittenConfig(out=str(tmp_path / "wa"), sources="arith", **base)))
    shard = out.read(0)
    assert shard.item_ids == ("arith/1", "arith/3")
    from presto_sd.models.loading import load_tokenizer

    tok = load_tokenizer(str(tiny_target_dir))
    want = tok(arithmetic_solutions(4, seed=0)["arith/3"], add_special_tokens=False)["input_ids"]
    assert list(shard.responses[1]) == [*want, tok.eos_token_id]
