"""Tree builders: from the drafter's marginals to a prefix-closed token tree.

- ``linear``: top-1 per position (DFlash).
- ``marginal``: best-first heap on ``log q`` (DDTree): each pop adds one node and pushes
  its next sibling and its first child.
- ``presto-beam``: PRESTO Algorithm 1, beam search with global retention: per depth,
  expand the top ``k`` children of each of the ``b`` frontier paths by ``s``, keep the
  global top ``b`` paths as the next frontier; every node added stays in the tree.
- ``presto-best-first``: the heap of ``marginal``, on prefix-aligned path scores.
- ``taps``: the heap on acceptance ``log a(u)`` (reach), cut at the budget ``B*`` that
  maximises expected tokens per second under the verifier's cost model (``taps.py``);
  ``budget`` is then a cap, not the size.

Budgets count draft nodes (the root/anchor excluded). Scores are ``<= 0`` so path scores
never grow along a path: best-first pops give the exact top-``B`` prefix-closed set.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from presto_sd.method.acceptance_calibration import AcceptanceCalibration
from presto_sd.method.cost_model import CostFit
from presto_sd.method.methods import TREE_METHODS
from presto_sd.method.scores import (
    DraftMarginals,
    RhoProvider,
    ScoringContext,
    prefix_aligned_scores,
)
from presto_sd.method.taps import choose_budget, round_seconds
from presto_sd.method.tree import TokenTree

# The most candidates per position (top_k) and paths (branching, beam) a tree may ask for:
# the drafter's scoring work grows with them (budget 1024 with top_k 49152 took 5 s of CPU
# a round, beam 256 x branching 256 3 s); at 64 the worst stays near the budget's own cost.
MAX_CANDIDATES = 64


@dataclass(frozen=True)
class TreeParams:
    """A tree's shape and scoring: configuration, the same every round of a request. Which
    builder reads it is the method's (``GenerationParams.method``, ``DraftCall.method``)."""

    # the defaults are every front's (the CLI, a request without them, the gRPC services):
    # the bench's fastest on a 2-core CPU (docs/benchmarks.md); a GPU pays for larger trees
    budget: int = 4  # draft nodes, root excluded
    depth: int = 15  # at most block_size - 1
    branching: int = 4  # k: children expanded per frontier path (presto-beam)
    beam: int = 4  # b: frontier paths kept per depth (presto-beam)
    lambdas: tuple[float, ...] = (1.0,)  # lambda_d per depth; the last repeats
    rho: str = "ngram"  # the rho provider PRESTO methods score with; TAPS's a(u)
    top_k: int = 10  # candidates kept per block position (the marginals' K)
    # TAPS's optional penalties: seconds per node, log-reach per depth level
    node_penalty_s: float = 0.0
    depth_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"tree.budget = {self.budget}: must be >= 1")
        if self.depth < 1:
            raise ValueError(f"tree.depth = {self.depth}: must be >= 1")
        for name in ("top_k", "branching", "beam"):
            value = getattr(self, name)
            if not 1 <= value <= MAX_CANDIDATES:
                raise ValueError(f"tree.{name} = {value}: must be in [1, {MAX_CANDIDATES}]")
        if not self.lambdas or any(lam < 0 for lam in self.lambdas):
            raise ValueError(f"tree.lambdas = {self.lambdas}: must be non-empty and >= 0")
        _check_seconds(self, ("node_penalty_s", "depth_penalty"))

    def lam(self, depth: int) -> float:
        return self.lambdas[min(depth, len(self.lambdas)) - 1]


@dataclass(frozen=True)
class RoundContext:
    """What the caller measured for this round (round state, never configuration): TAPS
    sizes its tree with it; the other builders ignore it (``taps_feedback.py`` makes it)."""

    cost: CostFit | None = None  # the verifier's cost model: seconds vs tree size and context
    draft_s: float = 0.0  # the drafter's seconds per round (0: this round's forward)
    # under load (batch_cost.py): what the shared forward's other rows commit per step
    shared_tokens: float = 0.0
    # a split deployment: the round's measured network time to both engines (taps.py's t_link)
    round_trip_s: float = 0.0
    # the map of a(u) fitted to the acceptance observed (acceptance_calibration.py)
    calibration: AcceptanceCalibration = AcceptanceCalibration()

    def __post_init__(self) -> None:
        _check_seconds(self, ("draft_s", "shared_tokens", "round_trip_s"))


def _check_seconds(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"tree.{name} = {value}: must be finite and >= 0")


@dataclass(frozen=True)
class BuiltTree:
    tree: TokenTree
    path_scores: tuple[float, ...]  # S(path to node); root 0
    # taps: each node's raw acceptance estimate log a(u), before the calibration; root 0
    node_log_acceptance: tuple[float, ...] = ()


class NodeScorer:
    """Scores each drafted prefix's candidate children at a depth: the marginal's top-K,
    or the rho provider's own per-parent proposal where it has one."""

    def __init__(
        self,
        ctx: ScoringContext,
        rho: RhoProvider | None = None,
        lambdas: Callable[[int], float] = lambda d: 0.0,
    ) -> None:
        self.ctx, self.rho, self.lambdas = ctx, rho, lambdas

    def child_scores(
        self, depth: int, prefixes: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate tokens [P, K] and their scores s [P, K] at ``depth``."""
        tokens, log_q = self.candidates(depth, prefixes)
        lam = self.lambdas(depth)
        if self.rho is None or lam == 0.0:
            return tokens, log_q
        log_rho = self.rho.log_rho(self.ctx, depth, prefixes, tokens, log_q)
        return tokens, prefix_aligned_scores(log_q, log_rho, lam)

    def candidates(self, depth: int, prefixes: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prefix's candidate children [P, K] and their ``log q`` [P, K]: the marginal's
        top-K at every node, or the rho provider's own per-parent proposal where it has one."""
        m = self.ctx.marginals
        propose = getattr(self.rho, "propose", None)
        if propose is not None:
            return propose(self.ctx, depth, prefixes, m.top_k)
        return (m.token_ids[depth - 1].expand(len(prefixes), -1),
                m.log_probs[depth - 1].float().expand(len(prefixes), -1))


class AcceptanceScorer(NodeScorer):
    """TAPS's node score ``log a(u)``: rho, or ``q`` itself without a provider, mapped by
    the request's calibration, with a node's candidates scaled to sum to at most 1, less
    the depth penalty. It keeps each candidate's raw estimate (before the map) by path,
    for the loop to fit the calibration on."""

    def __init__(
        self, ctx: ScoringContext, rho: RhoProvider | None, depth_penalty: float = 0.0,
        calibration: AcceptanceCalibration | None = None,
    ) -> None:
        super().__init__(ctx, rho)
        self.depth_penalty, self.calibration = depth_penalty, calibration or AcceptanceCalibration()
        self.raw_log_a: dict[tuple[int, ...], float] = {}  # drafted path -> raw log a(last node)

    def child_scores(self, depth: int, prefixes: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, log_q = self.candidates(depth, prefixes)
        log_a = log_q if self.rho is None else self.rho.log_rho(self.ctx, depth, prefixes, tokens, log_q)
        raw = log_a.clamp(max=0.0)
        for prefix, toks, row in zip(prefixes, tokens.tolist(), raw.tolist()):
            for tok, value in zip(toks, row):
                self.raw_log_a[(*prefix, tok)] = value
        log_a = self.calibration.apply_log(raw, depth)
        # siblings exclude each other (one child of a node at most is accepted), so their
        # a(u) sum to <= 1; a provider that scores each alone (h_phi), or a map, can promise more
        log_a = log_a - torch.logsumexp(log_a, dim=-1, keepdim=True).clamp(min=0.0)
        return tokens, log_a - self.depth_penalty


def build_linear_tree(anchor: int, marginals: DraftMarginals, params: TreeParams) -> BuiltTree:
    n = min(params.budget, params.depth, marginals.depth)
    tokens = [anchor] + marginals.token_ids[:n, 0].tolist()
    scores = [0.0] + marginals.log_probs[:n, 0].float().cumsum(0).tolist()
    return BuiltTree(TokenTree.from_lists(tokens, list(range(-1, n))), tuple(scores))


def _best_first(
    anchor: int, max_depth: int, budget: int, scorer: NodeScorer,
    stop: Callable[[float], bool] | None = None,
) -> BuiltTree:
    """Pop the best open node until ``budget`` nodes (or ``stop(its path score)``)."""
    tokens, parents, scores, prefixes = [anchor], [-1], [0.0], [[]]
    children: dict[int, tuple[list[int], list[float]]] = {}  # node -> sorted candidates
    heap: list[tuple[float, int, int, int]] = []  # (-S, tiebreak, parent, rank)
    counter = 0

    def push_child(parent: int, rank: int) -> None:
        nonlocal counter
        toks, ss = children[parent]
        if rank < len(toks):
            heapq.heappush(heap, (-(scores[parent] + ss[rank]), counter, parent, rank))
            counter += 1

    def expand(node: int, depth: int) -> None:
        if depth < max_depth:
            toks, s = scorer.child_scores(depth + 1, [prefixes[node]])
            order = torch.argsort(s[0], descending=True, stable=True)
            children[node] = (toks[0, order].tolist(), s[0, order].tolist())
            push_child(node, 0)

    expand(0, 0)
    depths = [0]
    while heap and len(tokens) - 1 < budget:
        neg_s, _, parent, rank = heapq.heappop(heap)
        tok = children[parent][0][rank]
        node = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        scores.append(-neg_s)
        prefixes.append(prefixes[parent] + [tok])
        depths.append(depths[parent] + 1)
        if len(tokens) - 1 == budget or (stop is not None and stop(-neg_s)):
            break  # the tree is complete: its last node's children would be scored for nothing
        push_child(parent, rank + 1)
        expand(node, depths[node])
    return BuiltTree(TokenTree(tuple(tokens), tuple(parents), tuple(depths)), tuple(scores))


def build_marginal_tree(anchor: int, marginals: DraftMarginals, params: TreeParams) -> BuiltTree:
    ctx = ScoringContext(marginals=marginals, context_tokens=[anchor])
    depth = min(params.depth, marginals.depth)
    return _best_first(anchor, depth, params.budget, NodeScorer(ctx))


def build_presto_best_first_tree(
    anchor: int, ctx: ScoringContext, rho: RhoProvider, params: TreeParams
) -> BuiltTree:
    depth = min(params.depth, ctx.marginals.depth)
    return _best_first(anchor, depth, params.budget, NodeScorer(ctx, rho, params.lam))


def build_presto_beam_tree(
    anchor: int, ctx: ScoringContext, rho: RhoProvider, params: TreeParams
) -> BuiltTree:
    scorer = NodeScorer(ctx, rho, params.lam)
    tokens, parents, scores, depths = [anchor], [-1], [0.0], [0]
    frontier: list[tuple[int, list[int]]] = [(0, [])]  # (node, drafted prefix)
    for depth in range(1, min(params.depth, ctx.marginals.depth) + 1):
        room = params.budget - (len(tokens) - 1)
        if room <= 0 or not frontier:
            break
        toks, s = scorer.child_scores(depth, [p for _, p in frontier])
        k = min(params.branching, toks.shape[1])
        top_s, top_i = torch.topk(s, k, dim=1)  # top-k children of each frontier path
        cands = []
        for row, (node, prefix) in enumerate(frontier):
            for j in range(k):
                tok = int(toks[row, top_i[row, j]])
                cands.append((scores[node] + float(top_s[row, j]), node, prefix + [tok]))
        cands.sort(key=lambda c: -c[0])  # stable: ties keep frontier then rank order
        cands = cands[:room]
        added = []
        for path_score, parent, prefix in cands:  # global retention: all of them stay
            added.append((len(tokens), prefix))
            tokens.append(prefix[-1])
            parents.append(parent)
            scores.append(path_score)
            depths.append(depth)
        frontier = added[: params.beam]
    return BuiltTree(TokenTree(tuple(tokens), tuple(parents), tuple(depths)), tuple(scores))


def _taps_early_stop(params: TreeParams, round_: RoundContext, base: int) -> Callable[[float], bool]:
    """Stop popping once no bigger tree can beat the best rate so far (exact, no depth penalty).

    From two nodes on, each node adds the same ``m`` seconds (the cost model is linear
    past its step from one token to a tree) and reach never grows in pop order, so after
    the ``B``-th pop (``B >= 1``), of reach ``r``, every larger tree's rate is at most
    ``max(rate(B), r / m)``: once ``r / m <= best`` the answer is among the popped.
    """
    per_node = round_.cost.marginal_node_s(base) + params.node_penalty_s

    def seconds(b: int) -> float:  # choose_budget's denominator: the same rates, exactly
        return float(round_seconds(b, round_.cost, base, round_.draft_s, params.node_penalty_s,
                                   round_.round_trip_s))

    others = round_.shared_tokens  # the shared forward's other rows: in every rate's numerator
    state = {"nodes": 0, "expected": 0.0, "best": (others + 1.0) / max(seconds(0), 1e-9)}

    def stop(log_reach: float) -> bool:
        reach = math.exp(log_reach)
        state["nodes"] += 1
        state["expected"] += reach
        rate = (others + 1 + state["expected"]) / max(seconds(state["nodes"]), 1e-9)
        state["best"] = max(state["best"], rate)
        return per_node > 0 and reach <= state["best"] * per_node

    return stop


def build_taps_tree(
    anchor: int, ctx: ScoringContext, rho: RhoProvider | None, params: TreeParams, round_: RoundContext,
) -> BuiltTree:
    """Pop nodes by reach up to the cap ``params.budget``, then keep the first ``B*``."""
    if round_.cost is None:
        raise ValueError("tree.method 'taps' needs tree.cost: the verifier's cost model (its Info)")
    depth = min(params.depth, ctx.marginals.depth)
    base = len(ctx.context_tokens) - 1
    stop = None if params.depth_penalty > 0 else _taps_early_stop(params, round_, base)
    scorer = AcceptanceScorer(ctx, rho, params.depth_penalty, round_.calibration)
    full = _best_first(anchor, depth, params.budget, scorer, stop)
    t = full.tree
    # pop order is node order; the depth penalty steers the ranking, not the reach
    reaches = [math.exp(s + params.depth_penalty * d) for s, d in zip(full.path_scores[1:], t.depths[1:])]
    choice = choose_budget(reaches, round_.cost, base, round_.draft_s, params.node_penalty_s,
                           round_.shared_tokens, round_.round_trip_s)
    keep = choice.budget + 1
    tree = TokenTree(t.tokens[:keep], t.parents[:keep], t.depths[:keep])
    raw = [0.0] + [scorer.raw_log_a[tuple(tree.path_tokens(u)[1:])] for u in range(1, keep)]
    return BuiltTree(tree, full.path_scores[:keep], tuple(raw))


def build_tree(
    method: str,
    anchor: int,
    ctx: ScoringContext,
    params: TreeParams,
    rho: RhoProvider | None = None,
    round_: RoundContext = RoundContext(),
) -> BuiltTree:
    """Dispatch on ``method``; PRESTO methods need a rho provider (TAPS: optional, and
    this round's measurements, ``round_``)."""
    if method == "linear":
        return build_linear_tree(anchor, ctx.marginals, params)
    if method == "marginal":
        return build_marginal_tree(anchor, ctx.marginals, params)
    if method in ("presto-beam", "presto-best-first"):
        if rho is None:
            raise ValueError(f"method {method!r} needs a rho provider")
        builder = build_presto_beam_tree if method == "presto-beam" else build_presto_best_first_tree
        return builder(anchor, ctx, rho, params)
    if method == "taps":
        return build_taps_tree(anchor, ctx, rho, params, round_)
    raise ValueError(f"tree.method = {method!r}: unknown (choose from {', '.join(TREE_METHODS)})")
