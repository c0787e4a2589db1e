"""A refused command says why in one line (``presto-sd: ...``) and leaves nothing behind; a bug
keeps its traceback (``presto_sd/app/errors.py``)."""

from __future__ import annotations

import pytest

from presto_sd.app.cli import main
from presto_sd.app.datasets import DatasetError
from presto_sd.app.errors import UsageError
from presto_sd.app.training.average import AverageError
from presto_sd.app.training.link import LinkError
from presto_sd.app.training.token_corpus import CorpusError


def test_each_groups_refusal_is_a_usage_error_and_still_a_value_error():
    for cls in (LinkError, AverageError, CorpusError, DatasetError):
        assert issubclass(cls, UsageError) and issubclass(cls, ValueError), cls


@pytest.mark.parametrize("argv, why", [
    (["train", "link", "--first-shard", "0", "--shards", "1", "--average", "0"],
     r"--average 0.0: the trained weights' share, in \(0, 1\]"),
    (["train", "link", "--first-shard", "0", "--shards", "1", "--mix", "corpus-without-window"],
     "--mix 'corpus-without-window': expected CORPUS:FIRST:SHARDS"),
    (["train", "link", "--first-shard", "0", "--shards", "1", "--corpus", "{tmp}/no-corpus"],
     r"shards 0-0: the corpus lacks \[0\] \(grow it first\)"),
    (["train", "link", "--first-shard", "0", "--shards", "1", "--written", "--written-sources", "code,poems"],
     "--written-sources 'code,poems': written answers come from"),
])
def test_a_refused_link_is_one_line_and_writes_nothing(argv, why, tmp_path):
    work = tmp_path / "work"
    with pytest.raises(SystemExit, match=f"^presto-sd: {why}") as refused:
        main([a.format(tmp=tmp_path) for a in argv] + ["--work", str(work)])
    assert "\n" not in str(refused.value.code)
    assert not work.exists()


@pytest.mark.parametrize("argv, why", [
    (["bench", "--datasets", "nope", "--n", "1", "--methods", "ar"], "unknown dataset 'nope'; known: gsm8k"),
    (["bench", "--datasets", "gsm8k", "--n", "1", "--methods", "nope"],
     "unknown bench method 'nope'; known: ar"),
    (["bench", "--replay", "--temperature", "0.5", "--datasets", "gsm8k", "--n", "1"],
     r"replay: greedy only \(--temperature 0\)"),
    (["train", "drafter", "--data", ""], "--data: no dir given"),
])
def test_a_refused_bench_or_training_run_is_one_line_and_writes_nothing(argv, why, tmp_path):
    with pytest.raises(SystemExit, match=f"^presto-sd: {why}"):
        main([*argv, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_an_output_dir_that_must_be_new_is_one_line(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept").write_text("mine")
    with pytest.raises(SystemExit, match=r"^presto-sd: .*out is not empty: export writes a new drafter dir"):
        main(["train", "export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")])
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["kept"]


@pytest.mark.parametrize("error, one_line", [(CorpusError("a refusal"), True),
                                             (ValueError("a bug"), False), (RuntimeError("a bug"), False)])
def test_only_a_usage_error_is_one_line_a_bug_keeps_its_traceback(error, one_line, monkeypatch):
    from presto_sd.app.training import cli as train_cli

    def run(args):
        raise error

    monkeypatch.setattr(train_cli, "run", run)
    argv = ["train", "link", "--first-shard", "0", "--shards", "1", "--work", "unused"]
    with pytest.raises(SystemExit if one_line else type(error), match="a refusal" if one_line else "a bug"):
        main(argv)
