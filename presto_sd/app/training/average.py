"""``presto-sd train average``: a drafter's weights averaged with its parent's (or its chain's).

A link trains its parent on a window of new data at a re-warmed learning rate; the trained
weights alone replayed below their parent on the held-out mix (the fourteenth link: linear
2.386 against 2.410), while the midpoint of the two beat both on every drafter-only row
(linear 2.430, marginal@16 3.184 against 3.143; docs/training.md, "Averaged with its
parent"). Fine-tuned from one point, the two lie in one basin: the average keeps the parent's
breadth and the window's news. Only weights average; the predictors (h_phi, the n-gram table,
lambdas) belong to one drafter's marginals, so the averaged dir has none: ``train
acceptance`` fits them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from presto_sd.app.errors import OutputExistsError, UsageError
from presto_sd.app.training.export import KEPT, write_drafter_dir
from presto_sd.models.dflash import DFlashDraftModel

REPORT = "average_report.json"


class AverageError(UsageError, ValueError):
    """Drafters whose weights cannot be averaged (other shapes, configs or token maps)."""


def average_drafters(drafters: Sequence[str | Path], out: str | Path, weights: Sequence[float] | None = None,
                     dtype: torch.dtype | None = None) -> Path:
    """Write the weighted average of ``drafters`` (``weights`` normalised; equal when not given)
    to the new drafter dir ``out``, in ``dtype`` (by default the first's on disk). The first
    drafter is the newest, the one the average stands for: its config (so whether there is a
    prefix head), training log and report are kept. Where the first has a prefix head, it is
    averaged over the drafters that have one (a head is trained on one drafter's states: with
    one only, it is the first's); where it has none, the others' are dropped.
    ``average_report.json`` says what went in. Refused, writing nothing, unless all have one
    architecture and one token map."""
    paths, out = [Path(d) for d in drafters], Path(out)
    weights = [1.0] * len(paths) if weights is None else [float(w) for w in weights]
    if len(paths) < 2 or len(weights) != len(paths):
        raise AverageError(f"{len(paths)} drafters, {len(weights)} weights: at least two, one weight each")
    if any(not w > 0 for w in weights):  # also NaN
        raise AverageError(f"weights {weights}: each > 0 (a drafter with none is left out)")
    if out.exists() and any(out.iterdir()):
        raise OutputExistsError(f"{out} is not empty: average writes a new drafter dir")
    models = [DFlashDraftModel.load(p) for p in paths]
    for path, model in zip(paths[1:], models[1:]):
        if why := _why_not_averageable(models[0], model):
            raise AverageError(f"{paths[0]} and {path} cannot be averaged: {why}")
    states = [m.state_dict() for m in models]
    averaged = {}
    for k in states[0]:
        having = [(s[k], w) for s, w in zip(states, weights) if k in s]  # a head: those that have one
        weight_sum = sum(w for _, w in having)
        averaged[k] = sum(v * (w / weight_sum) for v, w in having)
    first = models[0]
    first.load_state_dict(averaged)
    if dtype is None:
        config = json.loads((paths[0] / "config.json").read_text())
        dtype = getattr(torch, str(config.get("torch_dtype")), None)
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32  # "auto", none: fp32
    # the first's log and report; not its own average report: the new one, written last, marks the dir whole
    write_drafter_dir(first, out, dtype, paths[0], tuple(n for n in KEPT if n != REPORT))
    total = sum(weights)
    (out / REPORT).write_text(json.dumps({"drafters": [
        {"path": str(p), "share": round(w / total, 6), "weights_sha256": weights_digest(p),
         "prefix_head": m.prefix_head is not None} for p, w, m in zip(paths, weights, models)]},
        indent=2) + "\n")
    return out


def _why_not_averageable(a: DFlashDraftModel, b: DFlashDraftModel) -> str:
    """Why ``b``'s weights cannot go into an average that stands for ``a`` ('' when they can)."""
    sa, sb = ({k: v for k, v in m.state_dict().items() if not k.startswith("prefix_head.")} for m in (a, b))
    if sa.keys() != sb.keys():
        return f"other weights ({sorted(sa.keys() ^ sb.keys())[:3]}): another architecture"
    if shapes := [k for k in sa if sa[k].shape != sb[k].shape]:
        return f"other shapes ({shapes[:3]}): another architecture"
    if a.prefix_head is not None and b.prefix_head is not None and (
            a.config.prefix_head_rank != b.config.prefix_head_rank):
        return "prefix heads of other ranks"
    if replace(a.config, prefix_head_rank=None) != replace(b.config, prefix_head_rank=None):
        return "other configs (block size, mask token, target layers...): another drafter"
    if (a.d2t is None) != (b.d2t is None) or (a.d2t is not None and not torch.equal(a.d2t, b.d2t)):
        return "other token maps (a drafter's rows are its map's tokens)"
    return ""


def weights_digest(path: Path) -> str:
    """One sha256 over a drafter dir's weight files (the token map's aside), in name order."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        if f.name != "draft_vocab.safetensors":
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()
