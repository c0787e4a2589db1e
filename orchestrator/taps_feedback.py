"""What a generation loop learns round by round and hands to TAPS (``TreeParams``).

- **Verify cost.** The verifier's own fit (``Info.cost``: its start-up calibration
  refined by its forwards) is the warm start; the loop refines it with what each round
  really cost it — the verify call as the loop sees it, transfer included in
  distributed mode.
- **Draft time.** A moving average of the round's fixed cost ``t_draft``.
- **Acceptance.** The map of ``a(u)`` that makes the trees' promised acceptance match
  what this request's target really accepts: Platt scaling with a depth term, fitted
  on every node whose parent was accepted (``presto_sd.acceptance_calibration``).
- **Draft backoff.** When TAPS keeps no tree (``B* = 0``) the round was a plain AR step
  that also paid for drafting and building. Such rounds come in runs (boilerplate the
  drafter cannot guess, code it never saw), so after one the loop skips drafting for
  1 round, then 2, 4, up to ``max_backoff`` while TAPS keeps choosing ``B* = 0``; a
  round that keeps a tree resets it.

Only ``taps`` reads it; one per request, so the acceptance factor follows its domain.
"""

from __future__ import annotations

from dataclasses import replace

from presto_sd.acceptance_calibration import OnlineAcceptanceCalibrator, node_trials
from presto_sd.builders import TreeParams
from presto_sd.cost_model import DraftTimer, OnlineCostModel
from presto_sd.tree import TokenTree
from verifier_service.engine import Verifier


class TapsFeedback:
    def __init__(self, verifier: Verifier, max_backoff: int = 8) -> None:
        prior = verifier.cost_model() or verifier.calibrate_cost()
        if prior is None:
            raise ValueError("method 'taps' needs the verifier's cost model, and it has none")
        self.verify = OnlineCostModel(prior=prior)
        self.draft = DraftTimer()
        self.acceptance = OnlineAcceptanceCalibrator()
        self._sent = self.acceptance.calibration  # the map the last tree was built with
        self.max_backoff = max_backoff
        self._backoff = self._skip = 0  # rounds to skip after the next B* = 0; left to skip

    def should_draft(self) -> bool:
        """False for the rounds the backoff skips (each call is one round)."""
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def tree_params(self, params: TreeParams) -> TreeParams:
        """``params`` with this round's cost model, draft-time estimate and acceptance map."""
        self._sent = self.acceptance.calibration
        return replace(params, cost=self.verify.fit, draft_s=self.draft.value or 0.0, calibration=self._sent)

    def observe(
        self, tree: TokenTree | None, path_scores: tuple[float, ...], depth_penalty: float,
        base: int, accepted: tuple[int, ...], draft_s: float, verify_s: float,
    ) -> None:
        """One round on a context of ``base``: the tree verified (None: a plain step) and
        its path scores, the draft tokens accepted, and what drafting and verifying cost."""
        self.verify.observe(tree.size + 1 if tree is not None else 1, base, verify_s)
        if draft_s > 0:
            self.draft.observe(draft_s)
        if tree is None:  # skipped or fallen back: nothing learned about drafting
            return
        # the scores are calibrated log a(u) less the depth penalty: back to the raw estimate
        cal, ps = self._sent, path_scores
        raw = [0.0] + [cal.invert_log(ps[u] - ps[tree.parents[u]] + depth_penalty, tree.depths[u])
                       for u in range(1, len(tree.tokens))]
        self.acceptance.observe(node_trials(tree, raw, accepted))
        if tree.size == 0:
            self._backoff = min(self.max_backoff, max(1, 2 * self._backoff))
            self._skip = self._backoff
        else:
            self._backoff = 0
