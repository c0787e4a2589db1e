"""What a generation loop learns round by round and hands to TAPS (``RoundContext``).

- **Verify cost.** The verifier's own fit (``Info.cost``: its start-up calibration
  refined by its forwards) is the warm start; the loop refines it with what each round
  really cost it — the verify call as the loop sees it, transfer included in
  distributed mode.
- **Load.** Where others share the forward (a step of many sequences), TAPS weighs a
  tree against the whole forward's rate (``StepEngine.shared_forward``, the step
  engine's measure of its last step: ``presto_sd.method.batch_cost``): trees shrink
  toward AR steps as the load grows and grow back as it falls. The lone fit learns only
  from forwards the request ran alone; the gate compares the forward's rate with and without the tree.
- **Draft time.** A moving average of the round's fixed cost ``t_draft``: the drafter's
  work and the commit, without the network.
- **The link.** In a split deployment every drafted round pays a round trip to the drafter
  and one to the verifier beyond their work (``Verifier.round_trip_s`` /
  ``Drafter.round_trip_s``: what their clients measure on every call, a median of the
  last ones, so one spike does not move it). TAPS prices each round with their sum
  (``RoundContext.round_trip_s``): a slow link makes rounds dear, so bigger trees and fewer
  rounds pay. The verify and draft times the loop learns from are its wall times less
  those round trips, so the network is counted once. An AR step pays the verifier's.
- **Acceptance.** The map of ``a(u)`` that makes the trees' promised acceptance match
  what this request's target really accepts: Platt scaling with a depth term, fitted
  on every node whose parent was accepted (``presto_sd.method.acceptance_calibration``).
- **Draft gate.** Drafting is itself a choice: a drafted round that keeps no tree
  (``B* = 0``) is an AR step that also paid for drafting and building, and a tree that
  gets little accepted can cost more than the AR steps it replaces. The loop measures
  each drafted round's saving against plain AR steps for the same tokens,
  ``tokens * t_ar - t_round`` with ``t_ar`` the cost model's one-token verify plus a
  commit, and keeps a moving average (weight 0.1 on the newest, from 0). While it is
  negative the loop skips drafting for 1 round, then 2, 4, up to ``max_backoff`` (8).
  In a shared forward with ``O`` other streams a losing probe slows every one of them
  (on a CPU the drafter's forward also takes the verifier's cores), so probes are rarer
  there: the backoff starts at ``O + 1`` and grows to ``max(max_backoff_loaded, 2(O + 1))``
  (32 at least), each skip drawn from ``[b, 2b)`` (seeded by the request) so that streams
  that started together do not all probe in the same forward (a batch leaves without the
  streams that are drafting, and a herd of them splits it); and a stream that joins a
  loaded forward waits ``[0, O + 1)`` rounds before its first probe. A skipped
  round is a plain AR step (the drafter gets its delta with the next draft); a drafted
  round that brings the average back to >= 0 resets the backoff. The average moves only
  on drafted rounds, so after a long losing stretch it takes a few good probes, up to
  ``max_backoff`` rounds apart, to reopen. Where trees pay (a GPU, a good drafter) the
  gate stays open; where nothing beats AR, ``taps`` runs mostly AR steps and probes.

Only ``taps`` reads it; one per request, so what it learns follows the request's domain.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from presto_sd.engine.drafter import Drafter
from presto_sd.engine.messages import InvalidArgumentError
from presto_sd.engine.verifier import Verifier
from presto_sd.method.acceptance_calibration import OnlineAcceptanceCalibrator, node_trials
from presto_sd.method.batch_cost import SharedForward
from presto_sd.method.builders import RoundContext
from presto_sd.method.cost_model import MovingAverage, OnlineCostModel
from presto_sd.method.tree import TokenTree


class TapsFeedback:
    def __init__(self, verifier: Verifier, drafter: Drafter | None = None, max_backoff: int = 8,
                 max_backoff_loaded: int = 32, seed: int | str = 0,
                 load: Callable[[int], SharedForward | None] = lambda rows: None) -> None:
        """``load(rows)``: the forward a tree would share with other sequences' rows, given
        this sequence's share of the last one (``StepEngine.shared_forward``); None alone."""
        prior = verifier.cost_model() or verifier.calibrate_cost()
        if prior is None:
            # a named refusal (the request's error), not an engine fault: the method cannot run here
            raise InvalidArgumentError("method 'taps' needs the verifier's cost model, and it has none (a "
                                       "verifier fits it at start-up: `presto-sd serve verifier`; an engine "
                                       "built by hand: `calibrate_cost()`)")
        self.verify = OnlineCostModel(prior=prior)
        self.draft, self.commit = MovingAverage(), MovingAverage()
        # seconds a drafted round saves over AR steps: from a neutral 0, with a memory of
        # ~10 drafted rounds, so it follows the mean saving rather than a streak
        self.saving = MovingAverage(alpha=0.1, initial=0.0)
        self.acceptance = OnlineAcceptanceCalibrator()
        self.max_backoff = max_backoff
        # in a shared forward a probe costs every stream in it, not only this one: probe less
        self.max_backoff_loaded = max(max_backoff, max_backoff_loaded)
        self._backoff = self._skip = 0  # rounds to skip at the next closing; left to skip
        self._joined = False  # has the first round looked at the load
        self._jitter = random.Random(seed)  # spreads loaded streams' probes over the forwards
        self._verifier, self._rows = verifier, 1  # this request's rows in its last forward
        self._drafter, self._load = drafter, load

    def round_trips(self) -> tuple[float, float]:
        """Seconds a round pays the links beyond the engines' work: (drafter, verifier)."""
        drafter_s = self._drafter.round_trip_s() if self._drafter is not None else 0.0
        return drafter_s, self._verifier.round_trip_s()

    def should_draft(self) -> bool:
        """False for the rounds the gate skips (each call is one round)."""
        if not self._joined:  # joining a loaded forward: spread the newcomers' first probes
            self._joined = True
            shared = self._load(self._rows)
            if shared is not None:
                self._skip = self._jitter.randrange(int(shared.others_tokens) + 1)
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def round_context(self) -> RoundContext:
        """This round's cost model, load, draft-time estimate, links and acceptance map."""
        shared = self._load(self._rows)
        cost, others = (shared.cost, shared.others_tokens) if shared else (self.verify.fit, 0.0)
        return RoundContext(cost=cost, shared_tokens=others, draft_s=self.draft.value or 0.0,
                            round_trip_s=sum(self.round_trips()), calibration=self.acceptance.calibration)

    def observe(
        self, tree: TokenTree | None, node_log_acceptance: tuple[float, ...], base: int,
        accepted: tuple[int, ...], draft_s: float, verify_s: float, commit_s: float,
    ) -> None:
        """One round on a context of ``base``: the tree verified (None: no draft) and each
        node's raw acceptance estimate, the draft tokens accepted, and what each step of
        the round cost."""
        rows = tree.size + 1 if tree is not None else 1
        shared = self._load(self._rows)  # what this round's tree was priced on
        drafter_link_s, verifier_link_s = self.round_trips()
        if shared is None:  # a shared forward's wall time would teach the lone fit the others' rows
            self.verify.observe(rows, base, max(verify_s - verifier_link_s, 1e-6))
        self._rows = rows
        self.commit.observe(commit_s)
        if tree is None:  # skipped or fallen back: nothing learned about drafting
            return
        # TAPS's t_draft: the round's fixed cost, the link apart (``round_trip_s`` prices it)
        self.draft.observe(max(draft_s - drafter_link_s, 0.0) + commit_s)
        if len(node_log_acceptance) == len(tree.tokens):  # a drafter that predates it sends none
            try:
                self.acceptance.observe(node_trials(tree, node_log_acceptance, accepted))
            except ValueError:  # a foreign drafter's tree with twin siblings: learn nothing from it
                pass
        others = 0.0
        if shared is not None:  # the shared forward's rate with the tree against without it
            # an AR step pays the verifier's link too (a drafted round pays both, in its wall time)
            others, verify_s = shared.others_tokens, float(shared.cost.seconds(rows, base)) + verifier_link_s
            ar_forward_s = float(shared.cost.seconds(1, base)) + verifier_link_s + self.commit.value
            ar_step_s = ar_forward_s / (others + 1)
        else:
            ar_step_s = float(self.verify.fit.seconds(1, base)) + verifier_link_s + self.commit.value
        tokens = others + len(accepted) + 1
        self.saving.observe(tokens * ar_step_s - (draft_s + verify_s + commit_s))
        if self.saving.value < 0:
            floor = 1 if shared is None else int(shared.others_tokens) + 1
            cap = self.max_backoff if shared is None else max(self.max_backoff_loaded, 2 * floor)
            self._backoff = min(cap, max(floor, 2 * self._backoff))
            self._skip = self._backoff
            if shared is not None:
                self._skip += self._jitter.randrange(self._backoff)
        else:
            self._backoff = 0
