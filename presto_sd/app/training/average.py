"""``presto-sd train average``: a drafter's weights averaged with its parent's.

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
import shutil
from pathlib import Path

import torch

from presto_sd.app.training.export import KEPT
from presto_sd.models.dflash import DFlashDraftModel

REPORT = "average_report.json"


class AverageError(ValueError):
    """Two drafters whose weights cannot be averaged (other shapes, token maps or heads)."""


def average_drafters(parent: str | Path, child: str | Path, out: str | Path, child_share: float = 0.5,
                     dtype: torch.dtype | None = None) -> Path:
    """Write ``(1 - child_share) * parent + child_share * child`` to the new drafter dir ``out``
    (in ``dtype``, by default the child's on disk), with the child's training log and report
    and an ``average_report.json``. Refused, writing nothing, unless the two have one
    architecture, one token map and both or neither a prefix head."""
    parent, child, out = Path(parent), Path(child), Path(out)
    if not 0.0 < child_share <= 1.0:
        raise AverageError(f"--child-share {child_share}: a share of the child in (0, 1]")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: average writes a new drafter dir")
    mine, theirs = DFlashDraftModel.load(child), DFlashDraftModel.load(parent)
    why = _why_not_averageable(mine, theirs)
    if why:
        raise AverageError(f"{child} and {parent} cannot be averaged: {why}")
    state, base = mine.state_dict(), theirs.state_dict()
    mine.load_state_dict({k: (1.0 - child_share) * base[k] + child_share * v for k, v in state.items()})
    if dtype is None:
        dtype = getattr(torch, json.loads((child / "config.json").read_text()).get("torch_dtype", "float32"))
    mine.save(out, dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in KEPT:
        found = next((p for p in (child / name, child.parent / name) if p.is_file()), None)
        if found is not None:
            shutil.copyfile(found, out / name)
    (out / REPORT).write_text(json.dumps({
        "child_share": child_share, "parent": str(parent), "child": str(child),
        "parent_weights_sha256": weights_digest(parent), "child_weights_sha256": weights_digest(child),
    }, indent=2) + "\n")
    return out


def _why_not_averageable(a: DFlashDraftModel, b: DFlashDraftModel) -> str:
    if (a.prefix_head is None) != (b.prefix_head is None):
        return "one has a prefix head, the other none (add-head first, or average the drafters without)"
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape for k in sa) and a.config != b.config:
        return "other configs (block size, mask token, target layers...): another drafter"
    if sa.keys() != sb.keys():
        return f"other weights ({sorted(sa.keys() ^ sb.keys())[:3]}): another architecture"
    if shapes := [k for k in sa if sa[k].shape != sb[k].shape]:
        return f"other shapes ({shapes[:3]}): another architecture"
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
