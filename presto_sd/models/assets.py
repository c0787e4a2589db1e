"""What a drafter directory holds besides its DFlash checkpoint, read in one place.

A drafter directory may carry PRESTO assets beside ``config.json`` and
``model.safetensors``: ``ngram.json.gz`` (an n-gram table from target-generated text),
``h_phi/`` (the learned acceptance predictor) and ``presto.json`` (the lambdas and rho
fitted on held-out traces, ``presto-sd train acceptance``). Whatever is there is used;
the rest keeps its defaults. Standard library only: the engine contracts carry
``DrafterDefaults`` in ``DrafterInfo`` (docs/design.md §3).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PRESTO_FILE = "presto.json"
NGRAM_FILE = "ngram.json.gz"
H_PHI_DIR = "h_phi"
CALIBRATED_RHO = "hphi"  # the acceptance estimate trained to be calibrated (TAPS sums reaches)


class DrafterNotFoundError(FileNotFoundError):
    """``--drafter`` names neither a local directory nor a drafter the hub could provide."""


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
