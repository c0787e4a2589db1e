"""The generated code in presto_pb/ is what scripts/gen_protos.py makes of protos/ today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path):
    gen = _gen_module()
    fresh = {p.relative_to(tmp_path): p.read_text() for p in gen.generate(tmp_path)}
    committed = {
        p.relative_to(ROOT): p.read_text()
        for p in (ROOT / "presto_pb").rglob("*")
        if p.suffix in (".py", ".pyi")
    }
    stale = sorted(str(k) for k in fresh.keys() | committed.keys() if fresh.get(k) != committed.get(k))
    assert not stale, f"stale generated code, run scripts/gen_protos.py: {stale}"


def test_services_are_described():
    from presto_pb.v1 import drafter_pb2, verifier_pb2

    drafter = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"]
    verifier = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"]
    assert {m.name for m in drafter.methods} == {"Prefill", "Draft", "DraftBatch", "Commit", "Close", "Info"}
    assert {m.name for m in verifier.methods} == {"Prefill", "Verify", "VerifyBatch", "Step", "Close", "Info"}
    assert drafter.full_name == "presto.v1.DrafterService"
