"""Rules the suite keeps so that it passes in any order, in one process."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_only_the_session_fixture_starts_or_stops_ray():
    # a second ray.init after a ray.shutdown, with an earlier orchestrator's threads still
    # alive, segfaults now and then (ray-project/ray#31145): conftest.ray_runtime is the one
    starts = {p.name for p in TESTS.glob("*.py")
              if p.name != "conftest.py" and re.search(r"\bray\.(init|shutdown)\(", p.read_text())}
    assert not starts, f"start Ray through the ray_runtime fixture instead: {sorted(starts)}"
