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

from presto_sd.app.errors import FlagError, OutputExistsError
from presto_sd.models.assets import DIGESTS_FILE, PRESTO_FILE, write_digests
from presto_sd.models.dflash import DFlashDraftModel

# beside the weights, or in the run dir above; an averaged drafter's report says what went in
KEPT = ("training_report.json", "train_log.jsonl", "average_report.json")
HEAD_RHOS = ("prefix", "prefix-ngram", "prefix-lookup")  # a prefix head's rhos: their lambdas are its
HEAD_REPORT = "prefix_head_report.json"  # the head's training report, in the drafter dir it joined


def export_drafter(checkpoint: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the drafter at ``checkpoint`` (a ``train drafter`` output's ``drafter`` dir) to
    ``out`` in ``dtype``, with its log and report; ``out`` must be new or empty."""
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and any(out.iterdir()):
        raise OutputExistsError(f"{out} is not empty: export writes a new drafter dir")
    model = DFlashDraftModel.load(checkpoint)  # refuses missing or unexpected weights
    return write_drafter_dir(model, out, dtype, checkpoint)


def write_drafter_dir(model: DFlashDraftModel, out: Path, dtype: torch.dtype, source: Path,
                      kept: tuple[str, ...] = KEPT) -> Path:
    """``model`` saved to ``out`` in ``dtype`` (its config saying so), with the ``kept`` files
    found beside ``source`` (a drafter dir) or in the run dir above it."""
    model.save(out, dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = str(dtype).removeprefix("torch.")  # what the weights on disk are
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in kept:
        found = next((p for p in (source / name, source.parent / name) if p.is_file()), None)
        if found is not None:
            shutil.copyfile(found, out / name)
    return out


def add_prefix_head(checkpoint: str | Path, drafter: str | Path) -> Path:
    """Put the prefix head of ``checkpoint`` (``train drafter --init-drafter DRAFTER
    --prefix-only``'s output) into the drafter dir ``drafter``, in the dtype of its weights.

    Refused, changing nothing, when the checkpoint's drafter weights are not ``drafter``'s
    (a head is trained on one drafter's states). The head's report is kept as
    ``prefix_head_report.json``; lambdas fitted for a head it replaces are dropped from
    ``presto.json`` (the default rho falls back to ``ngram`` if it was one of them); the
    digests are rewritten. ``train choose-lambda`` then chooses ``prefix-ngram``'s lambda.
    """
    checkpoint, drafter = Path(checkpoint), Path(drafter)
    trained = DFlashDraftModel.load(checkpoint)
    if trained.prefix_head is None:
        raise FlagError(f"{checkpoint} has no prefix head (train it with --prefix-rank R --prefix-only)")
    config = json.loads((drafter / "config.json").read_text())
    dtype = getattr(torch, config.get("torch_dtype", "float32"))
    base = DFlashDraftModel.load(drafter, dtype)
    mine = {k: v.to(dtype) for k, v in trained.state_dict().items() if not k.startswith("prefix_head.")}
    theirs = {k: v for k, v in base.state_dict().items() if not k.startswith("prefix_head.")}
    if mine.keys() != theirs.keys() or not all(torch.equal(mine[k], theirs[k]) for k in mine) or (
            (trained.d2t is None) != (base.d2t is None)
            or (trained.d2t is not None and not torch.equal(trained.d2t, base.d2t))):
        raise FlagError(f"{checkpoint}'s drafter weights are not {drafter}'s: a head is trained on "
                        "the drafter it ships with (train drafter --init-drafter DRAFTER --prefix-only)")
    config.setdefault("dflash_config", {})["prefix_head_rank"] = trained.config.prefix_head_rank
    trained.save_prefix_head(drafter, dtype)
    (drafter / "config.json").write_text(json.dumps(config, indent=2))
    report = next((p for p in (checkpoint / KEPT[0], checkpoint.parent / KEPT[0]) if p.is_file()), None)
    (drafter / HEAD_REPORT).unlink(missing_ok=True)  # an older head's
    if report is not None:
        shutil.copyfile(report, drafter / HEAD_REPORT)
    presto_file = drafter / PRESTO_FILE
    if presto_file.is_file():
        presto = json.loads(presto_file.read_text())
        by_rho = {k: v for k, v in presto.get("lambdas_by_rho", {}).items() if k not in HEAD_RHOS}
        if presto.get("rho") in HEAD_RHOS:
            rho = "ngram" if "ngram" in by_rho else next(iter(by_rho), "ngram")
            presto.update(rho=rho, lambdas=by_rho.get(rho, []))  # no lambdas: a request's are 1
        presto["lambdas_by_rho"] = by_rho
        presto_file.write_text(json.dumps(presto, indent=2))
    if (drafter / DIGESTS_FILE).is_file():
        write_digests(drafter)
    return drafter
