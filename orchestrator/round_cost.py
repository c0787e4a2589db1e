"""What a generation loop knows of round costs, handed to TAPS each round.

The verifier's own fit (``Info.cost``: its start-up calibration refined by its forwards)
is the warm start; the loop then refines it with what each round really cost it — the
verify call as the loop sees it, transfer included in distributed mode — and keeps a
moving average of the drafter's seconds per round (``t_draft``). Only ``taps`` reads it.
"""

from __future__ import annotations

from dataclasses import replace

from presto_sd.builders import TreeParams
from presto_sd.cost_model import DraftTimer, OnlineCostModel
from verifier_service.engine import Verifier


class RoundCostTracker:
    def __init__(self, verifier: Verifier) -> None:
        prior = verifier.cost_model() or verifier.calibrate_cost()
        if prior is None:
            raise ValueError("method 'taps' needs the verifier's cost model, and it has none")
        self.verify = OnlineCostModel(prior=prior)
        self.draft = DraftTimer()

    def tree_params(self, params: TreeParams) -> TreeParams:
        """``params`` with this round's cost model and draft-time estimate."""
        return replace(params, cost=self.verify.fit, draft_s=self.draft.value or 0.0)

    def observe(self, tree_nodes: int, base: int, draft_s: float, verify_s: float) -> None:
        """One round: ``tree_nodes`` verified (root included) on a context of ``base``."""
        self.verify.observe(tree_nodes, base, verify_s)
        if draft_s > 0:
            self.draft.observe(draft_s)
