"""``presto-sd train export``: a trained checkpoint becomes a drafter dir that ships."""

from __future__ import annotations

import json

import pytest
import torch

from presto_sd.app.training.export import export_drafter
from presto_sd.models.dflash import DFlashDraftModel
from tests.conftest import tiny_drafter_model


def test_export_casts_the_weights_and_keeps_the_log_and_report(tiny_target, tmp_path):
    run = tmp_path / "run"
    model = tiny_drafter_model(tiny_target)
    model.save(run / "drafter")  # as train drafter leaves it: fp32, the log in the run dir
    (run / "drafter" / "training_report.json").write_text(json.dumps({"heldout_acc": [0.5]}))
    (run / "train_log.jsonl").write_text('{"step": 10}\n')

    out = export_drafter(run / "drafter", tmp_path / "ship")

    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "training_report.json",
                                               "train_log.jsonl"}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    shipped = DFlashDraftModel.load(out, dtype=torch.bfloat16)
    for (name, a), (_, b) in zip(model.state_dict().items(), shipped.state_dict().items()):
        assert torch.equal(a.to(torch.bfloat16), b), name  # the weights, rounded once to bf16
    assert (out / "model.safetensors").stat().st_size < (run / "drafter" / "model.safetensors").stat().st_size


def test_export_refuses_a_dir_with_files_and_a_checkpoint_without_weights(tiny_target, tmp_path):
    tiny_drafter_model(tiny_target).save(tmp_path / "ckpt")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(FileExistsError):
        export_drafter(tmp_path / "ckpt", tmp_path / "busy")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="missing weights"):
        export_drafter(tmp_path / "ckpt", tmp_path / "new")
    assert not (tmp_path / "new").exists()
