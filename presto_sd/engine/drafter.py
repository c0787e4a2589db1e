"""The drafter engine interface: proposes a scored token tree per round.

One interface, two implementations: ``DFlashDrafter`` (in-process) and the gRPC client
(remote). The generation loop and the orchestrator only see this class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from presto_sd.engine.messages import (
    EngineError,
    FeatureDelta,
    InvalidArgumentError,
    LimitExceededError,
    answer_of,
    check_base,
)
from presto_sd.engine.sessions import KVMemory
from presto_sd.engine.verifier import MaskChains
from presto_sd.method.builders import RoundContext, TreeParams
from presto_sd.method.methods import Method, get_method
from presto_sd.method.scores import DraftMarginals, RhoProvider
from presto_sd.method.tree import TokenTree
from presto_sd.models.assets import DrafterDefaults


@dataclass(frozen=True)
class DrafterInfo:
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    vocab_size: int
    methods: tuple[str, ...]
    rho_providers: tuple[str, ...]
    name: str = ""
    defaults: DrafterDefaults = field(default_factory=DrafterDefaults)  # fitted PRESTO settings, if shipped
    max_sessions: int = 0  # 0: not stated
    memory: KVMemory = field(default_factory=KVMemory, compare=False)  # live: context K/V bytes, budget


@dataclass(frozen=True)
class DraftResult:
    tree: TokenTree
    marginals: DraftMarginals
    path_scores: tuple[float, ...]
    forward_s: float  # the drafter forward and its lm_head
    build_s: float  # tree building + scoring
    node_log_acceptance: tuple[float, ...] = ()  # taps: raw log a(u) per node (BuiltTree)
    chains: MaskChains | None = None  # self-speculative: the mask rows its verify carries


@dataclass(frozen=True)
class DraftCall:
    """One request's share of a batched draft (``Drafter.draft_batch``)."""

    session_id: str
    anchor: int
    base: int
    method: str  # the tree builder (a name of ``TREE_METHODS``)
    params: TreeParams
    commit: FeatureDelta | None = None  # applied first (``commit_and_draft``); base = commit.end
    context: RoundContext = RoundContext()  # what the caller measured this round (TAPS)


class Drafter(ABC):
    @abstractmethod
    def info(self) -> DrafterInfo: ...

    @abstractmethod
    def prefill(self, session_id: str, delta: FeatureDelta, restart: bool = False) -> int:
        """Start a session from the prompt's features (``delta.start == 0``); ``restart``
        replaces the open one of that id (without it an open id is ``AlreadyExistsError``).

        Returns the session's base (``delta.end``).
        """

    @abstractmethod
    def draft(self, session_id: str, anchor: int, base: int, method: str, params: TreeParams,
              context: RoundContext = RoundContext()) -> DraftResult:
        """Marginals for the block after ``anchor`` (at position ``base``) and the tree that
        ``method`` builds from them."""

    def draft_batch(self, calls: Sequence[DraftCall]) -> list[DraftResult | EngineError]:
        """Draft for several sessions; each answer is its call's result or its error.

        One call's refusal never fails the others. This default drafts one call after
        another; engines that can run every block in ONE forward override it, with the
        same trees.
        """
        out: list[DraftResult | EngineError] = []
        for c in calls:
            try:
                if c.commit is None:
                    out.append(self.draft(c.session_id, c.anchor, c.base, c.method, c.params, c.context))
                else:
                    out.append(self.commit_and_draft(c.session_id, c.commit, c.anchor, c.base, c.method,
                                                     c.params, c.context))
            except EngineError as e:
                out.append(answer_of(e))
        return out

    def commit_and_draft(self, session_id: str, delta: FeatureDelta, anchor: int, base: int, method: str,
                         params: TreeParams, context: RoundContext = RoundContext()) -> DraftResult:
        """``commit`` then ``draft`` (``base`` = ``delta.end``): the loop's usual round, ONE
        call to a remote drafter. The engines check the whole call before the commit
        applies, so a refused one changes nothing (this default, for others, commits
        first); a call that failed in flight may have applied it, and the next then finds
        the base moved on (stale)."""
        self.commit(session_id, delta)
        return self.draft(session_id, anchor, base, method, params, context)

    def round_trip_s(self) -> float:
        """What a call costs beyond the engine's own work (``Verifier.round_trip_s``); 0 in process."""
        return 0.0

    @abstractmethod
    def commit(self, session_id: str, delta: FeatureDelta) -> int:
        """Extend the context cache by a verified round's features; returns the new base."""

    @abstractmethod
    def close(self, session_id: str) -> None: ...


class CheckedDrafter(Drafter):
    """An in-process drafter whose every call goes through ``draft_batch`` (its ``draft`` and
    ``commit_and_draft`` are a batch of one): one path checks every call."""

    def draft(self, session_id: str, anchor: int, base: int, method: str, params: TreeParams,
              context: RoundContext = RoundContext()) -> DraftResult:
        return self._one(DraftCall(session_id, anchor, base, method, params, context=context))

    def commit_and_draft(self, session_id: str, delta: FeatureDelta, anchor: int, base: int, method: str,
                         params: TreeParams, context: RoundContext = RoundContext()) -> DraftResult:
        return self._one(DraftCall(session_id, anchor, base, method, params, commit=delta, context=context))

    def _one(self, call: DraftCall) -> DraftResult:
        result = self.draft_batch([call])[0]
        if isinstance(result, EngineError):
            raise result
        return result


def check_draft_call(c: DraftCall, session_base: int, vocab_size: int, max_budget: int,
                     rho_providers: dict[str, RhoProvider],
                     rho_hint: str = "") -> tuple[Method, RhoProvider | None]:
    """What every drafter checks of a draft call before it changes anything: the base (the
    commit's start, and its end as the draft's base), the anchor, the budget, the method and
    its rho provider. Returns the method and the rho it scores with (None: it needs none)."""
    if c.commit is None:
        check_base(c.session_id, session_base, c.base)
    else:
        check_base(c.session_id, session_base, c.commit.start)
        if c.base != c.commit.end:
            raise InvalidArgumentError(f"draft.base = {c.base}: must be the commit's end, {c.commit.end}")
    if not 0 <= c.anchor < vocab_size:
        raise InvalidArgumentError(f"draft.anchor = {c.anchor}: out of range [0, {vocab_size})")
    if c.params.budget > max_budget:
        raise LimitExceededError(f"tree.budget = {c.params.budget}: over the drafter's limit {max_budget}")
    try:
        method = get_method(c.method, "tree.method")
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None
    rho = None
    # TAPS may take its acceptance from q itself: rho "marginal"
    if method.uses_rho and not (method.sizes_itself and c.params.rho == "marginal"):
        rho = rho_providers.get(c.params.rho)
        if rho is None:
            raise InvalidArgumentError(
                f"tree.rho = {c.params.rho!r}: unknown (have {', '.join(rho_providers)}{rho_hint})")
    return method, rho
