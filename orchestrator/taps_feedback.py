"""What a generation loop learns round by round and hands to TAPS (``TreeParams``).

- **Verify cost.** The verifier's own fit (``Info.cost``: its start-up calibration
  refined by its forwards) is the warm start; the loop refines it with what each round
  really cost it — the verify call as the loop sees it, transfer included in
  distributed mode.
- **Draft time.** A moving average of the round's fixed cost ``t_draft``.
- **Acceptance.** The factor on ``E[T]`` that makes the trees' promised acceptance match
  what this request really gets (``presto_sd.taps.AcceptanceCalibrator``).

Only ``taps`` reads it; one per request, so the acceptance factor follows its domain.
"""

from __future__ import annotations

from dataclasses import replace

from presto_sd.builders import TreeParams
from presto_sd.cost_model import DraftTimer, OnlineCostModel
from presto_sd.taps import AcceptanceCalibrator, expected_accepted
from presto_sd.tree import TokenTree
from verifier_service.engine import Verifier


class TapsFeedback:
    def __init__(self, verifier: Verifier) -> None:
        prior = verifier.cost_model() or verifier.calibrate_cost()
        if prior is None:
            raise ValueError("method 'taps' needs the verifier's cost model, and it has none")
        self.verify = OnlineCostModel(prior=prior)
        self.draft = DraftTimer()
        self.acceptance = AcceptanceCalibrator()

    def tree_params(self, params: TreeParams) -> TreeParams:
        """``params`` with this round's cost model, draft-time estimate and E[T] factor."""
        return replace(params, cost=self.verify.fit, draft_s=self.draft.value or 0.0,
                       reach_scale=self.acceptance.scale)

    def observe(
        self, tree: TokenTree | None, path_scores: tuple[float, ...], depth_penalty: float,
        base: int, accepted: int, draft_s: float, verify_s: float,
    ) -> None:
        """One round on a context of ``base``: the tree verified (None: a plain step),
        the draft tokens it got accepted, and what drafting and verifying cost."""
        self.verify.observe(tree.size + 1 if tree is not None else 1, base, verify_s)
        if draft_s > 0:
            self.draft.observe(draft_s)
        if tree is not None:
            self.acceptance.observe(expected_accepted(path_scores, tree.depths, depth_penalty), accepted)
