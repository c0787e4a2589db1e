"""What a drafter directory holds besides its DFlash checkpoint, read in one place.

A drafter directory may carry PRESTO assets beside ``config.json`` and
``model.safetensors``: ``ngram.json.gz`` (an n-gram table from target-generated text),
``h_phi/`` (the learned acceptance predictor) and ``presto.json`` (the lambdas and rho
fitted on held-out traces, ``presto-sd train acceptance``). Whatever is there is used;
the rest keeps its defaults. Standard library only: the engine contracts carry
``DrafterDefaults`` in ``DrafterInfo`` (docs/design.md §3).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PRESTO_FILE = "presto.json"
NGRAM_FILE = "ngram.json.gz"
H_PHI_DIR = "h_phi"
CALIBRATED_RHO = "hphi"  # the acceptance estimate trained to be calibrated (TAPS sums reaches)
DIGESTS_FILE = "sha256.json"  # every file a drafter dir ships, with its sha256
PREFIX_HEAD_FILE = "prefix_head.safetensors"  # the prefix head's weights, apart from the drafter's


class DrafterNotFoundError(FileNotFoundError):
    """``--drafter`` names neither a local directory nor a drafter the hub could provide."""


class DrafterAssetError(ValueError):
    """A drafter directory lacks its weights, or a file differs from its ``sha256.json``."""


def file_digests(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (but the digest file itself), by relative path."""
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file() and f.name != DIGESTS_FILE}


def has_prefix_head(path: Path) -> bool:
    """Does the drafter dir's config name a prefix head (``dflash_config.prefix_head_rank``)?"""
    config = json.loads((Path(path) / "config.json").read_text())
    return bool(config.get("dflash_config", {}).get("prefix_head_rank"))


def write_digests(path: Path) -> Path:
    """Record the digests of a drafter dir about to ship (``presto-sd train`` writes the files)."""
    out = Path(path) / DIGESTS_FILE
    out.write_text(json.dumps(file_digests(Path(path)), indent=1, sort_keys=True) + "\n")
    return out


def check_drafter_dir(path: Path) -> None:
    """Refuse a drafter dir without its weights, or whose files differ from its digests.

    A missing ``model.safetensors`` must never turn into random weights: the output would
    still be exact but nothing accepted, and no one would know why it got slow.
    """
    not_weights = ("draft_vocab.safetensors", PREFIX_HEAD_FILE)  # beside the drafter's own weights
    weights = [f for f in path.glob("*.safetensors") if f.name not in not_weights]
    missing = [name for name, ok in (("config.json", (path / "config.json").is_file()),
                                     ("weights (*.safetensors)", bool(weights))) if not ok]
    if missing:
        raise DrafterAssetError(f"drafter dir {path} has no {', '.join(missing)}: "
                                "a drafter dir holds a DFlash checkpoint (docs/training.md)")
    digests = path / DIGESTS_FILE
    if not digests.exists():
        return
    want, have = json.loads(digests.read_text()), file_digests(path)
    bad = sorted(f for f, d in want.items() if have.get(f) != d)
    if bad:
        raise DrafterAssetError(f"drafter dir {path}: {', '.join(bad)} missing or differing from "
                                f"{DIGESTS_FILE} (a partial checkout, an edit, or Git LFS pointers)")


@dataclass(frozen=True)
class DrafterDefaults:
    """The PRESTO settings fitted for one drafter (its ``presto.json``); empty: none shipped.

    ``rho`` is the provider the fit chose, ``lambdas`` its lambda_d, and
    ``lambdas_by_rho`` the lambda_d fitted for every provider it tried.
    """

    rho: str | None = None
    lambdas: tuple[float, ...] = ()
    lambdas_by_rho: dict[str, tuple[float, ...]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict) -> DrafterDefaults:
        return cls(
            rho=d.get("rho") or None,
            lambdas=tuple(float(x) for x in d.get("lambdas", ())),
            lambdas_by_rho={str(rho): tuple(float(x) for x in lams)
                            for rho, lams in d.get("lambdas_by_rho", {}).items()},
        )

    def calibrated_rho(self, providers: Iterable[str] = ()) -> str | None:
        """h_phi where the drafter has one (fitted for it here, or among its ``providers``)."""
        return CALIBRATED_RHO if CALIBRATED_RHO in {*self.lambdas_by_rho, *providers} else None

    def tree_settings(
        self, rho: str | None, lambdas: tuple[float, ...] | None, wants_calibrated: bool = False,
        providers: Iterable[str] = (),
    ) -> tuple[str, tuple[float, ...]]:
        """``(rho, lambdas)`` for a request: what it sets wins, the rest is this drafter's.

        An unset rho is the fitted one (``wants_calibrated``: h_phi where there is one);
        unset lambdas are the ones fitted for that rho, else the fitted default, else 1.
        """
        if rho is None:
            rho = (self.calibrated_rho(providers) if wants_calibrated else None) or self.rho or "ngram"
        if lambdas is None:
            lambdas = self.lambdas_by_rho.get(rho) or self.lambdas or (1.0,)
        return rho, tuple(lambdas)


@dataclass(frozen=True)
class DrafterAssets:
    """A drafter directory's files (``path`` None: a random, untrained drafter)."""

    path: Path | None
    defaults: DrafterDefaults = DrafterDefaults()

    @classmethod
    def read(cls, path: Path | None) -> DrafterAssets:
        if path is not None:
            check_drafter_dir(path)
        presto = path / PRESTO_FILE if path is not None else None
        if presto is None or not presto.exists():
            return cls(path)
        return cls(path, DrafterDefaults.from_json(json.loads(presto.read_text())))

    @property
    def name(self) -> str:
        return str(self.path) if self.path is not None else "random"

    @property
    def config(self) -> dict | None:
        """The DFlash ``config.json`` (None for a random drafter: built from the target's)."""
        return json.loads((self.path / "config.json").read_text()) if self.path is not None else None

    @property
    def ngram_table(self) -> Path | None:
        p = self.path / NGRAM_FILE if self.path is not None else None
        return p if p is not None and p.exists() else None

    @property
    def h_phi_dir(self) -> Path | None:
        p = self.path / H_PHI_DIR if self.path is not None else None
        return p if p is not None and (p / "h_phi.json").exists() else None
