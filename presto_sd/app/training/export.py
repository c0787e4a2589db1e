"""``presto-sd train export``: a trained drafter checkpoint as a directory that can ship.

``train drafter`` writes fp32 weights (``RUN/drafter``) beside its optimizer state and log;
what ships is the drafter alone, its weights in bf16 (half the bytes; loading casts them to
the target's dtype), its training log and report kept for the reader. ``train acceptance``
then adds the predictors and the ``sha256.json`` that guards the whole directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from presto_sd.models.dflash import DFlashDraftModel

KEPT = ("training_report.json", "train_log.jsonl")  # beside the weights, or in the run dir above


def export_drafter(checkpoint: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the drafter at ``checkpoint`` (a ``train drafter`` output's ``drafter`` dir) to
    ``out`` in ``dtype``, with its log and report; ``out`` must be new or empty."""
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: export writes a new drafter dir")
    model = DFlashDraftModel.load(checkpoint)  # refuses missing or unexpected weights
    model.save(out, dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = str(dtype).removeprefix("torch.")  # what the weights on disk are
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in KEPT:
        found = next((p for p in (checkpoint / name, checkpoint.parent / name) if p.is_file()), None)
        if found is not None:
            shutil.copyfile(found, out / name)
    return out
