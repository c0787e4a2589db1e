"""``presto-sd train average``: drafters' weights averaged (a link's with its parent's, a chain's)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from presto_sd.app.training.average import REPORT, AverageError, average_drafters
from presto_sd.models.dflash import DFlashConfig, DFlashDraftModel
from tests.conftest import tiny_drafter_model


def pair(target, tmp_path, **child_kw):
    """A parent and a child of one architecture, fp32 on disk, the child with its log."""
    parent, child = tiny_drafter_model(target, seed=1), tiny_drafter_model(target, seed=2, **child_kw)
    parent.save(tmp_path / "parent")
    child.save(tmp_path / "run" / "drafter")
    (tmp_path / "run" / "train_log.jsonl").write_text('{"step": 10}\n')
    return parent, child


def test_the_average_is_the_weighted_midpoint_with_the_childs_log(tiny_target, tmp_path):
    parent, child = pair(tiny_target, tmp_path)
    for share in (0.5, 0.25):
        out = average_drafters([tmp_path / "run/drafter", tmp_path / "parent"], tmp_path / f"a{share}",
                               [share, 1 - share])
        got = DFlashDraftModel.load(out).state_dict()
        for k, p in parent.state_dict().items():
            assert torch.equal(got[k], share * child.state_dict()[k] + (1 - share) * p), (share, k)
        assert (out / "train_log.jsonl").read_text() == '{"step": 10}\n'  # the newest's, the first
        report = json.loads((out / REPORT).read_text())["drafters"]
        assert [d["share"] for d in report] == [share, 1 - share]
        assert report[0]["weights_sha256"] != report[1]["weights_sha256"]
    # no predictors: they belong to one drafter's marginals (train acceptance fits the average's)
    assert not {"presto.json", "h_phi", "ngram.json.gz", "sha256.json"} & {p.name for p in out.iterdir()}


def test_a_chain_averages_with_equal_weights_and_its_heads_over_those_that_have_one(tiny_target, tmp_path):
    pair(tiny_target, tmp_path)
    variant(tiny_target, tmp_path / "headed", prefix_head_rank=4)
    variant(tiny_target, tmp_path / "headed2", prefix_head_rank=4, seed=4)
    a, b, c = (DFlashDraftModel.load(tmp_path / d).state_dict() for d in ("headed", "headed2", "parent"))
    out = average_drafters([tmp_path / "headed", tmp_path / "headed2", tmp_path / "parent"], tmp_path / "avg")
    got = DFlashDraftModel.load(out).state_dict()
    for k, v in got.items():
        want = (a[k] / 2 + b[k] / 2) if k.startswith("prefix_head.") else (a[k] / 3 + b[k] / 3 + c[k] / 3)
        assert torch.allclose(v, want, atol=1e-6), k
    report = json.loads((out / REPORT).read_text())["drafters"]
    assert [d["prefix_head"] for d in report] == [True, True, False]
    assert not torch.equal(a["fc.weight"], b["fc.weight"]) and not torch.equal(a["fc.weight"], c["fc.weight"])
    # the first stands for the average: with no head, none (the others' heads are dropped)
    out = average_drafters([tmp_path / "parent", tmp_path / "headed"], tmp_path / "no-head")
    assert DFlashDraftModel.load(out).prefix_head is None


def test_the_average_keeps_the_childs_dtype_on_disk_unless_told(tiny_target, tmp_path):
    pair(tiny_target, tmp_path)
    child = DFlashDraftModel.load(tmp_path / "run" / "drafter")
    child.save(tmp_path / "bf16", dtype=torch.bfloat16)
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    (tmp_path / "bf16" / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    out = average_drafters([tmp_path / "bf16", tmp_path / "parent"], tmp_path / "avg")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    out = average_drafters([tmp_path / "bf16", tmp_path / "parent"], tmp_path / "avg32", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


def variant(target, path, layers: int | None = None, d2t: torch.Tensor | None = None, seed: int = 3,
            **dflash) -> None:
    """A tiny drafter saved at ``path`` with its config changed: layers, dflash_config fields, a token map."""
    tiny_drafter_model(target).save(path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = layers or config["num_hidden_layers"]
    config["dflash_config"].update(dflash, **({"draft_vocab_size": len(d2t)} if d2t is not None else {}))
    torch.manual_seed(seed)
    model = DFlashDraftModel(DFlashConfig.from_dict(config))
    model.d2t = d2t
    model.save(path)


def test_drafters_that_cannot_be_averaged_are_refused_writing_nothing(tiny_target, tmp_path):
    pair(tiny_target, tmp_path)
    parent, child = tmp_path / "parent", tmp_path / "run" / "drafter"
    for weights in ([0.0, 1.0], [-0.5, 1.5], [float("nan"), 1.0], [1.0]):
        with pytest.raises(AverageError, match="weight"):
            average_drafters([child, parent], tmp_path / "out", weights)
    with pytest.raises(AverageError, match="at least two"):
        average_drafters([child], tmp_path / "out")
    variant(tiny_target, tmp_path / "deeper", layers=2)
    variant(tiny_target, tmp_path / "other-block", block_size=8)  # the same shapes: another drafter still
    variant(tiny_target, tmp_path / "rank4", prefix_head_rank=4)
    variant(tiny_target, tmp_path / "rank8", prefix_head_rank=8)
    variant(tiny_target, tmp_path / "map-a", d2t=torch.arange(64))
    variant(tiny_target, tmp_path / "map-b", d2t=torch.arange(1, 65))
    for first, other, why in (("parent", "deeper", "another architecture"), ("rank4", "rank8", "other ranks"),
                              ("parent", "other-block", "other configs"), ("map-a", "map-b", "token maps"),
                              ("parent", "map-a", "other configs")):
        with pytest.raises(AverageError, match=why):
            average_drafters([tmp_path / first, tmp_path / other], tmp_path / "out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(FileExistsError):
        average_drafters([child, parent], tmp_path / "busy")
    assert not (tmp_path / "out").exists()


def test_the_cli_says_what_is_wrong_in_one_line(tiny_target, tmp_path, capsys):
    from presto_sd.app.cli import main

    pair(tiny_target, tmp_path)
    drafters = f"{tmp_path / 'run/drafter'},{tmp_path / 'parent'}"
    for argv, why in ((["--drafters", drafters, "--weights", "a,b"], "could not convert"),
                      (["--drafters", drafters, "--weights", "1"], "one weight each"),
                      (["--drafters", str(tmp_path / "parent")], "at least two")):
        with pytest.raises(SystemExit, match=f"presto-sd: train average: .*{why}"):
            main(["train", "average", *argv, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    main(["train", "average", "--drafters", drafters, "--weights", "3,1", "--out", str(tmp_path / "out")])
    assert json.loads((tmp_path / "out" / REPORT).read_text())["drafters"][0]["share"] == 0.75
