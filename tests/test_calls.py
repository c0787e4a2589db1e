"""Engine calls as values: each runs the interface method it names, and nothing else names one."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

from presto_sd.engine import calls
from presto_sd.engine.drafter import DraftCall
from presto_sd.engine.messages import FeatureDelta
from presto_sd.engine.verifier import PrefillCall, VerifyCall
from presto_sd.method.builders import RoundContext, TreeParams
from presto_sd.method.tree import TokenTree

ROOT = Path(__file__).resolve().parent.parent


class Recorder:
    """Any engine: records each method called and its arguments."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def __getattr__(self, name):
        return lambda *args: self.seen.append((name, *args)) or name


DELTA = FeatureDelta(3, (5, 6), torch.zeros(2, 4))
TREE = TokenTree.root_only(7)
PARAMS, MEASURED = TreeParams(), RoundContext(draft_s=0.01)


def test_each_call_runs_the_method_it_names():
    cases = [
        (calls.Info(), ("info",)),
        (calls.Close("s"), ("close", "s")),
        (calls.CloseIdle(5.0), ("close_idle", 5.0)),
        (calls.MaxContext(), ("max_context",)),
        (calls.CalibrateCost(), ("calibrate_cost",)),
        (calls.Prefill(PrefillCall("s", (1, 2), anchor=3, restart=True, decoded=1)),
         ("prefill", "s", [1, 2], PrefillCall("s", (1,)).sampling, 3, True, 1)),
        (calls.Verify(VerifyCall("s", 4, TREE, True)), ("verify", "s", 4, TREE, True)),
        (calls.Step("s", 4, 7), ("step", "s", 4, 7)),
        (calls.VerifyBatch((VerifyCall("s", 4, TREE),)), ("verify_batch", (VerifyCall("s", 4, TREE),))),
        (calls.DrafterPrefill("s", DELTA, True), ("prefill", "s", DELTA, True)),
        (calls.Commit("s", DELTA), ("commit", "s", DELTA)),
        (calls.Draft(DraftCall("s", 7, 4, "taps", PARAMS, context=MEASURED)),
         ("draft", "s", 7, 4, "taps", PARAMS, MEASURED)),
        (calls.Draft(DraftCall("s", 7, 5, "taps", PARAMS, commit=DELTA, context=MEASURED)),
         ("commit_and_draft", "s", DELTA, 7, 5, "taps", PARAMS, MEASURED)),
        (calls.DraftBatch((DraftCall("s", 7, 4, "linear", PARAMS),)),
         ("draft_batch", (DraftCall("s", 7, 4, "linear", PARAMS),))),
        (calls.Apply(str.upper), None),
    ]
    for call, want in cases:
        engine = Recorder()
        if want is None:
            assert call.run("probe") == "PROBE"
            continue
        assert call.run(engine) == want[0]
        [seen] = engine.seen
        assert len(seen) == len(want) and all(a is b or a == b for a, b in zip(seen, want)), call
        assert type(pickle.loads(pickle.dumps(call))) is type(call)  # they cross into Ray actors


def test_no_engine_method_is_named_by_a_string():
    """The actors, the replica pools and the servicers pass calls, never method names."""
    pattern = re.compile(r"""\.call\(\s*["']|\.run\(\s*(context|None)\s*,\s*["']"""
                         r"""|getattr\(\s*(self\.)?engine\s*,\s*method""")
    places = [*ROOT.glob("orchestrator/*.py"), *ROOT.glob("*_service/*.py"), *ROOT.glob("presto_sd/rpc/*.py"),
              *ROOT.glob("presto_sd/app/**/*.py")]
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in places
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders
