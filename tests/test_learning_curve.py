"""scripts/learning_curve.py --fit: where each of issue 27's targets falls on the fitted curve."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _curve() -> ModuleType:
    spec = importlib.util.spec_from_file_location("learning_curve", ROOT / "scripts" / "learning_curve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(tokens: float, linear: float, presto: float, marginal: float, bf16: bool = True) -> dict:
    return {"response_tokens": tokens, "bf16_training": bf16, "top1": {"gsm8k": 0.5},
            "tau": {"linear": {"gsm8k": linear},
                    "presto-best-first@16": {"gsm8k": presto, "all": presto},
                    "marginal@16": {"gsm8k": marginal, "all": marginal}}}


def test_fit_reads_the_gain_a_doubling_and_where_the_line_reaches_the_target():
    curve = _curve()
    # linear tau 2.0 at 4 M and 2.1 at 8 M: +0.1 a doubling, so 2.3 at 4 M * 2**3 = 32 M
    rows = [_row(4e6, 2.0, 2.8, 2.7), _row(8e6, 2.1, 2.9, 2.8),
            _row(1e6, 9.9, 9.9, 9.9),               # under min_tokens: not fitted
            _row(16e6, 9.9, 9.9, 9.9, bf16=False)]  # another recipe's dtype: not fitted
    fits = {(f["metric"], f["dataset"]): f for f in curve.fit(rows, min_tokens=3e6)}
    linear = fits[("linear", "gsm8k")]
    assert linear["points"] == 2
    assert linear["per_doubling"] == pytest.approx(0.1)
    assert linear["reaches_at_tokens"] == pytest.approx(32e6)
    assert not linear["met"]
    # top-1 flat at 0.5: its line never reaches 0.65
    assert fits[("top1", "gsm8k")]["reaches_at_tokens"] is None
    assert ("linear", "humaneval") not in fits  # no point has it
    # two points of one size: no slope to fit
    assert curve.fit([_row(4e6, 2.0, 2.8, 2.7), _row(4e6, 2.1, 2.9, 2.8)]) == []


def test_a_target_the_last_point_reads_is_met_even_where_the_line_falls():
    curve = _curve()
    rows = [_row(4e6, 2.5, 3.1, 2.7), _row(8e6, 2.4, 3.0, 2.8)]
    fits = {(f["metric"], f["dataset"]): f for f in curve.fit(rows)}
    assert fits[("linear", "gsm8k")]["met"] and fits[("linear", "gsm8k")]["reaches_at_tokens"] is None
    assert fits[("presto-best-first@16", "all")]["met"]


def test_lead_over_marginal_is_the_ratio_at_each_point():
    curve = _curve()
    # the shipped drafter's row has every tau but no size: left out
    shipped = {**_row(4e6, 2.0, 3.0, 2.5), "response_tokens": None}
    lead = curve.lead_over_marginal([_row(4e6, 2.0, 3.0, 2.5), shipped])
    assert lead == [(4e6, {"gsm8k": pytest.approx(1.2), "all": pytest.approx(1.2)})]
