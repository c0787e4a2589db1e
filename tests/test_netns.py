"""The split deployment across network namespaces (``scripts/bench_link.py --netns``).

The drafter and the verifier run as real servers in namespaces of their own, the loop in a
third, joined by veth pairs: the servers' addresses exist only there. Greedy output must
equal AR's at every delay and through a cut of each link, the clients must measure the
delay they paid, and nothing the run made may outlive it. Skipped, with the reason, where
the machine does not allow namespaces (not root, no ``ip netns``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from presto_sd.app.bench.netns import unavailable
from tests.conftest import tiny_drafter_model
from tests.test_orchestrator_procs import tiny_dir  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parent.parent
WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")


@pytest.fixture(scope="module")
def tiny_drafter_dir(tiny_dir, tmp_path_factory):  # noqa: F811 - the fixture above
    _, model, _ = tiny_dir
    path = tmp_path_factory.mktemp("netns-drafter")
    tiny_drafter_model(model).save(path)
    return path


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def test_output_equals_ar_across_namespaces_at_every_delay_and_through_a_cut(
        tiny_dir, tiny_drafter_dir, tmp_path):  # noqa: F811
    target, _, _ = tiny_dir
    before = _namespaces()
    cmd = [sys.executable, "scripts/bench_link.py", "--netns", "--target", str(target),
           "--drafter", str(tiny_drafter_dir), "--rtt-ms", "0,4", "--methods", "ar,presto-best-first@4,taps",
           "--max-new-tokens", "24", "--cut-at", "2,6", "--out", str(tmp_path), "--timeout-s", "240"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    topology = json.loads(done.stdout.splitlines()[0])
    assert all(a.startswith("10.77.") for a in topology["addresses"].values())  # not loopback
    result = json.loads((tmp_path / "link.json").read_text())
    assert len(result["rows"]) == 6 and all(r["equals_ar"] for r in result["rows"]), result["rows"]
    for r in result["rows"]:  # the clients measured the delay they paid, and little more
        links = [r["verifier_link_ms"]] + ([r["drafter_link_ms"]] if r["drafter_link_ms"] is not None else [])
        assert all((3.5 <= ms < 60) if r["rtt_ms"] == 4 else ms < 30 for ms in links), r
    assert result["cut"]["equals_ar"] and result["cut"]["fallback_rounds"] > 0, result["cut"]
    assert (tmp_path / "link.png").stat().st_size > 0
    assert _namespaces() <= before  # everything it made is gone
