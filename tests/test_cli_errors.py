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
])
def test_a_refused_link_is_one_line_and_writes_nothing(argv, why, tmp_path):
    work = tmp_path / "work"
    with pytest.raises(SystemExit, match=f"^presto-sd: {why}") as refused:
        main([a.format(tmp=tmp_path) for a in argv] + ["--work", str(work)])
    assert "\n" not in str(refused.value.code)
    assert not work.exists()


def test_an_unknown_dataset_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="^presto-sd: unknown dataset 'nope'; known: gsm8k"):
        main(["bench", "--datasets", "nope", "--n", "1", "--methods", "ar", "--out", str(tmp_path / "b")])


def test_a_bug_keeps_its_traceback(monkeypatch):
    from presto_sd.app.training import cli as train_cli

    def broken(args):
        raise RuntimeError("a bug, not a refusal")

    monkeypatch.setattr(train_cli, "run", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["train", "link", "--first-shard", "0", "--shards", "1", "--work", "unused"])
