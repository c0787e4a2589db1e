"""``SelfDrafter``: the target drafts its own trees, in the verify forward (self-speculative mode).

No drafter model runs. Each verify forward carries, after tree nodes, chains of mask rows
that the target computes through its self-draft adapter (``models/self_draft.py``); the
chain after the node the walk ends on gives the marginals of the next block, which come
back in the round's feature delta (``FeatureDelta.next_block``). This drafter builds the
next round's tree from them with any tree method (PRESTO's, marginal, linear, TAPS) and
names the nodes the next forward hangs chains after (``DraftResult.chains``). A round with
no marginals (the first, or one whose walk ended on a node without a chain) verifies the
root alone with a chain after it: one token, and a draft for the round after.

Because real rows never attend to mask rows, the output is exactly the target's AR output
(greedy) whatever the adapter drafts: every row that verifies is computed as without it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from presto_sd.engine.drafter import CheckedDrafter, DraftCall, DrafterInfo, DraftResult, check_draft_call
from presto_sd.engine.messages import (
    EngineError,
    FeatureDelta,
    InvalidArgumentError,
    answer_of,
    check_base,
    check_once_per_batch,
)
from presto_sd.engine.sessions import SessionTable
from presto_sd.engine.verifier import MaskChains
from presto_sd.method.builders import build_tree
from presto_sd.method.cost_model import CostFit
from presto_sd.method.methods import TREE_METHODS, get_method
from presto_sd.method.ngram import NGramModel
from presto_sd.method.scores import ConstantRho, DraftMarginals, NGramRho, RhoProvider, ScoringContext
from presto_sd.method.tree import TokenTree
from presto_sd.models.assets import DrafterDefaults

SELF_PREFIX = "self"  # ``--drafter self`` / ``self:DIR``: this mode


@dataclass
class _SelfSession:
    tokens: list[int]  # committed tokens, the pending anchor excluded
    ngram: NGramModel
    next_block: DraftMarginals | None = None  # drafted by the last verify forward
    last_used: float = field(default_factory=time.monotonic)

    @property
    def base(self) -> int:
        return len(self.tokens)

    @property
    def positions(self) -> int:
        return 0  # no K/V: the drafting rows live in the verifier's forward


def self_round_cost(cost: CostFit, depth: int, max_chains: int | None) -> CostFit:
    """The verifier's cost of a tree of ``n`` nodes, priced for this mode: the forward also
    carries the chains (``depth`` rows after each of ``n`` nodes, or after at most
    ``max_chains``), and is never a lone row. TAPS sizes self-speculative trees with it."""
    if max_chains is None:
        scale = 1 + depth
        return replace(cost, intercept_s=cost.intercept_s + cost.tree_s, tree_s=0.0,
                       per_node_s=cost.per_node_s * scale, per_node_context_s=cost.per_node_context_s * scale)
    extra = max_chains * depth  # once the tree has that many nodes: rows that do not grow with it
    return replace(cost, intercept_s=cost.intercept_s + cost.tree_s + cost.per_node_s * extra, tree_s=0.0,
                   per_context_s=cost.per_context_s + cost.per_node_context_s * extra / 1024)


class SelfDrafter(CheckedDrafter):
    def __init__(self, block: int, vocab_size: int, target_layer_ids: Sequence[int],
                 ngram_table: NGramModel | None = None, max_chains: int | None = None,
                 max_sessions: int = 256, name: str = SELF_PREFIX,
                 defaults: DrafterDefaults | None = None) -> None:
        """``block``: the adapter's deepest chain (``VerifierInfo.self_draft_block``);
        ``max_chains``: chains per forward, after the builder's first nodes (None: after
        every node, the quadratic mode: whatever prefix is accepted, its next draft is ready)."""
        if block < 1:
            raise ValueError(f"block {block}: a self-draft adapter drafts >= 1 position")
        if max_chains is not None and max_chains < 1:
            raise ValueError(f"max_chains {max_chains}: >= 1, or None for every node")
        self.block, self.vocab_size = block, vocab_size
        self.target_layer_ids = tuple(target_layer_ids)
        self.max_chains = max_chains
        self.rho_providers: dict[str, RhoProvider] = {"constant": ConstantRho(),
                                                      "ngram": NGramRho(ngram_table)}
        self.max_sessions, self.name = max_sessions, name
        self.defaults = defaults or DrafterDefaults()
        self.sessions: SessionTable[_SelfSession] = SessionTable("drafter", max_sessions)

    def info(self) -> DrafterInfo:
        return DrafterInfo(block_size=self.block + 1, target_layer_ids=self.target_layer_ids,
                           mask_token_id=-1, vocab_size=self.vocab_size, methods=TREE_METHODS,
                           rho_providers=tuple(self.rho_providers), name=self.name, defaults=self.defaults,
                           max_sessions=self.max_sessions, memory=self.sessions.memory())

    def close(self, session_id: str) -> None:
        self.sessions.close(session_id)

    def close_idle(self, ttl_s: float) -> list[str]:
        return self.sessions.close_idle(ttl_s)

    # -- context --------------------------------------------------------------------------
    def _check_delta(self, delta: FeatureDelta) -> None:
        bad = next((t for t in delta.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError(f"delta.tokens: token {bad} out of range [0, {self.vocab_size})")
        nb = delta.next_block
        if nb is not None and not 1 <= nb.depth <= self.block:
            raise InvalidArgumentError(
                f"delta.next_block: {nb.depth} positions, the adapter drafts 1..{self.block}")

    def prefill(self, session_id: str, delta: FeatureDelta, restart: bool = False) -> int:
        if delta.start != 0:
            raise InvalidArgumentError(f"prefill.delta.start = {delta.start}: must be 0")
        if not delta.tokens:
            raise InvalidArgumentError("prefill.delta: empty prompt")
        self._check_delta(delta)
        seat = self.sessions.seat(session_id, 0, restart, f"a prefill of {len(delta.tokens)} tokens")
        try:
            ngram = NGramModel(order=3, vocab_size=self.vocab_size)
            ngram.update(list(delta.tokens))
            session = _SelfSession(list(delta.tokens), ngram, delta.next_block)
            self.sessions.open(seat, session)
        finally:
            self.sessions.release(seat)
        return session.base

    def commit(self, session_id: str, delta: FeatureDelta) -> int:
        s = self.sessions.touch(session_id)
        check_base(session_id, s.base, delta.start)
        if not delta.tokens:
            raise InvalidArgumentError("commit.delta.tokens: empty (a round commits at least its anchor)")
        self._check_delta(delta)
        s.ngram.update(list(delta.tokens), history=s.tokens)
        s.tokens.extend(delta.tokens)
        s.next_block = delta.next_block
        return s.base

    # -- drafting -------------------------------------------------------------------------
    def draft_batch(self, calls: Sequence[DraftCall]) -> list[DraftResult | EngineError]:
        """Each call checked whole before its commit applies (a refused call changes nothing)."""
        out: list[DraftResult | EngineError] = []
        seen: set[str] = set()
        for j, c in enumerate(calls):
            try:
                check_once_per_batch(seen, c.session_id, f"draft_batch.calls[{j}]")
                s, rho, sizes_itself = self._check_draft(c)
                if c.commit is not None:
                    self.commit(c.session_id, c.commit)
                out.append(self._build(s, c, rho, sizes_itself))
            except EngineError as e:
                out.append(answer_of(e))
        return out

    def _check_draft(self, c: DraftCall) -> tuple[_SelfSession, RhoProvider | None, bool]:
        s = self.sessions.touch(c.session_id)
        method, rho = check_draft_call(c, s.base, self.vocab_size, 1024, self.rho_providers,
                                       "; h_phi reads a dedicated drafter's hidden states")
        if c.commit is not None:
            self._check_delta(c.commit)
        return s, rho, method.sizes_itself

    def _build(self, s: _SelfSession, c: DraftCall, rho: RhoProvider | None,
               sizes_itself: bool) -> DraftResult:
        depth = max(1, min(c.params.depth, self.block))
        if get_method(c.method).budgeted and not sizes_itself:  # a tree of B nodes is <= B deep:
            depth = min(depth, max(1, c.params.budget))  # longer chains would draft unused rows
        block = s.next_block
        t0 = time.perf_counter()
        if block is None:  # nothing drafted for this anchor: the root alone, and a chain after it
            tree, marginals, scores, raw = TokenTree.root_only(c.anchor), _empty(), (0.0,), ()
        else:
            d = min(depth, block.depth)
            marginals = block.head(d, c.params.top_k)
            measured = c.context
            if sizes_itself and measured.cost is not None:
                measured = replace(measured, cost=self_round_cost(measured.cost, depth, self.max_chains))
            ctx = ScoringContext(marginals, s.tokens + [c.anchor], s.ngram)
            try:
                built = build_tree(c.method, c.anchor, ctx, replace(c.params, depth=d), rho, measured)
            except ValueError as e:
                raise InvalidArgumentError(str(e)) from None
            tree, scores, raw = built.tree, built.path_scores, built.node_log_acceptance
        n = len(tree.tokens) if self.max_chains is None else min(self.max_chains, len(tree.tokens))
        chains = MaskChains(tuple(range(n)), depth, top_k=min(c.params.top_k, self.vocab_size))
        return DraftResult(tree, marginals, scores, 0.0, time.perf_counter() - t0, raw, chains)


def _empty() -> DraftMarginals:
    return DraftMarginals(torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1), torch.zeros(0))
