"""The verifier engine interface: the target model side of speculative decoding.

One interface, two implementations: ``HFVerifier`` (in-process, transformers) and the
gRPC client (remote). The generation loop and the orchestrator only see this class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from presto_sd.engine.messages import (
    EngineError,
    FeatureDelta,
    InvalidArgumentError,
    LimitExceededError,
    answer_of,
    check_base,
)
from presto_sd.engine.sessions import KVMemory
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.cost_model import CostFit
from presto_sd.method.tree import TokenTree, TreeError, TreeLimitError, TreeLimits
from presto_sd.models.invariant import MAX_INVARIANT_ROWS

# the most rows one verifier forward may hold: its kernels were probed row-invariant up to it
MAX_FORWARD_ROWS = MAX_INVARIANT_ROWS


@dataclass(frozen=True)
class VerifierLimits:
    max_sessions: int = 64
    max_context: int = 8192  # positions, prompt + generated + tree depth
    tree: TreeLimits = TreeLimits()


@dataclass(frozen=True)
class VerifierInfo:
    model: str
    dtype: str
    device: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    target_layer_ids: tuple[int, ...]
    limits: VerifierLimits = field(default_factory=VerifierLimits)
    cost: CostFit | None = None  # forward seconds vs tree size and context, fit online
    memory: KVMemory = field(default_factory=KVMemory, compare=False)  # live: KV bytes in use, budget
    row_invariant: bool = False  # each row computed as alone: greedy output bitwise its own AR's
    self_draft_block: int = 0  # the deepest mask chain its self-draft adapter drafts; 0: none
    # how its forward runs ("" where a server does not say): "owned" or "transformers";
    # "dense" or "gguf-int4" linears; the decode rows' attention kernel, "native", "sdpa" or "eager"
    decoder: str = ""
    weights: str = ""
    attention_kernel: str = ""
    prefill_chunk: int = 0  # tokens a prompt forward holds: a prompt's KV rounds by its chunks

    def arithmetic(self) -> dict[str, object]:
        """What decides the tokens a session's stream gets here: two verifiers that differ in
        any of it may continue a session moved between them (a resumed stream, a re-prefill)
        differently. (Fields a server does not report read empty, and compare as such.)"""
        return {"model": self.model, "dtype": self.dtype, "device": self.device.split(":")[0],
                "vocab_size": self.vocab_size, "row_invariant": self.row_invariant, "decoder": self.decoder,
                "weights": self.weights, "attention_kernel": self.attention_kernel,
                "prefill_chunk": self.prefill_chunk}


@dataclass(frozen=True)
class PrefillResult:
    anchor: int  # the first generated token (or the anchor given to prefill)
    delta: FeatureDelta  # features of every prompt token, start = 0
    base: int  # = len(prompt tokens)


@dataclass(frozen=True)
class VerifyResult:
    accepted: tuple[int, ...]  # accepted draft tokens, the root/anchor excluded
    bonus: int  # the target's own next token: the new anchor
    delta: FeatureDelta  # anchor + accepted tokens, start = the old base
    base: int  # new base = old base + len(accepted) + 1
    node_probs: torch.Tensor | None = None  # [N] p_T of each node's token (traces)
    accepted_nodes: tuple[int, ...] = ()  # tree indices of the accepted path, root first

    @property
    def new_tokens(self) -> tuple[int, ...]:
        """Tokens this round commits to the output: accepted ones then the bonus."""
        return (*self.accepted, self.bonus)


@dataclass(frozen=True)
class MaskChains:
    """Self-speculative rows of a verify (``models/self_draft.py``): a chain of ``depth``
    mask rows after each tree node of ``after``. The chain after the node the walk ends on
    drafts the next block: the result's ``delta.next_block``, its ``top_k`` per depth."""

    after: tuple[int, ...]
    depth: int
    top_k: int = 32

    @property
    def rows(self) -> int:
        return len(self.after) * self.depth


@dataclass(frozen=True)
class VerifyCall:
    """One request's share of a batched verification (``Verifier.verify_batch``)."""

    session_id: str
    base: int
    tree: TokenTree
    want_node_probs: bool = False
    chains: MaskChains | None = None  # self-speculative: draft the next block in this forward


@dataclass(frozen=True)
class PrefillCall:
    """A new session's prompt as an item of ``Verifier.verify_batch``: the prompt rides in the
    same target forward as other sessions' steps (``prefill``'s arguments)."""

    session_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    anchor: int | None = None
    restart: bool = False
    decoded: int = 0  # the last ``decoded`` of ``token_ids`` were decoded, not prompt (``prefill``)


BatchCall = VerifyCall | PrefillCall
BatchAnswer = VerifyResult | PrefillResult | EngineError


def call_rows(call: BatchCall) -> int:
    """Rows a batch item adds to the one verifier forward: a prompt's tokens, a tree's nodes
    and its mask chains."""
    if isinstance(call, PrefillCall):
        return len(call.token_ids)
    return len(call.tree.tokens) + (call.chains.rows if call.chains is not None else 0)


class Verifier(ABC):
    @abstractmethod
    def info(self) -> VerifierInfo: ...

    @abstractmethod
    def prefill(
        self,
        session_id: str,
        token_ids: list[int],
        sampling: SamplingParams = SamplingParams(),
        anchor: int | None = None,
        restart: bool = False,
        decoded: int = 0,
    ) -> PrefillResult:
        """Start a session on ``token_ids`` (``restart``: replace the open one of that id).

        Without ``anchor`` the first token is drawn from the target; with it (re-prefill
        after a verifier restart) that already-emitted token becomes the pending anchor.
        ``decoded``: how many of the last ``token_ids`` the session had decoded (a re-prefill's
        committed output, a resumed stream's): they are computed as the AR steps that
        decoded them, not as a prompt chunk, so the session goes on bitwise as the unbroken
        one would (a chunk rounds its rows its own way; at a near tie greedy output parts).
        0 <= decoded < len(token_ids) (else ``InvalidArgumentError``).
        An open id without ``restart`` is refused (``AlreadyExistsError``).
        """

    @abstractmethod
    def verify(
        self, session_id: str, base: int, tree: TokenTree, want_node_probs: bool = False,
        chains: MaskChains | None = None,
    ) -> VerifyResult:
        """One target forward over every tree node; sample-and-match; commit the path.
        ``chains``: self-speculative mask rows (refused, INVALID_ARGUMENT, where there is no
        adapter); their draft of the next block comes back in ``delta.next_block``."""

    def verify_batch(self, calls: Sequence[BatchCall]) -> list[BatchAnswer]:
        """Verify several sessions' trees, and prefill new sessions' prompts (``PrefillCall``);
        each answer is its call's result or its error.

        One call's refusal (a stale base, a bad tree) never fails the others. This default
        runs one call after another; engines that can put every tree and prompt into ONE
        forward override it, with results equal to these.
        """
        out: list[BatchAnswer] = []
        for c in calls:
            try:
                if isinstance(c, PrefillCall):
                    out.append(self.prefill(c.session_id, list(c.token_ids), c.sampling, c.anchor, c.restart,
                                            c.decoded))
                else:
                    out.append(self.verify(c.session_id, c.base, c.tree, c.want_node_probs, c.chains))
            except EngineError as e:
                out.append(answer_of(e))
        return out

    def step(self, session_id: str, base: int, anchor: int) -> VerifyResult:
        """One plain AR token: the verification of the root-only tree on ``anchor``.

        The caller holds the pending anchor (the loop keeps every committed token); an
        engine checks it against the session as it checks any tree's root.
        """
        return self.verify(session_id, base, TokenTree.root_only(anchor))

    def max_context(self) -> int:
        """Its context window: prompt + output tokens a session may hold (``limits``)."""
        return self.info().limits.max_context

    def cost_model(self) -> CostFit | None:
        """The live fit of forward seconds vs tree size and context (None: uncalibrated)."""
        return self.info().cost

    def round_trip_s(self) -> float:
        """What a call costs beyond the engine's own work: the network round trip and the
        messages' transfer to a remote engine, measured by its client (robust to spikes);
        0 in process. TAPS prices every round with it (``taps_feedback``)."""
        return 0.0

    def calibrate_cost(self) -> CostFit | None:
        """Measure forwards over a range of tree sizes and contexts; the fitted cost model.

        Engines that time their own forwards override this; a client of a remote verifier
        gets the server's fit (calibrated at its start-up).
        """
        return self.cost_model()

    @abstractmethod
    def close(self, session_id: str) -> None: ...


def check_prompt(token_ids: Sequence[int], anchor: int | None, vocab_size: int, max_context: int,
                 decoded: int = 0) -> None:
    """What a verifier checks of a prompt before it seats a session: not empty, every token
    (and the anchor) in the vocabulary, room for the anchor inside the context, at least
    one token of it prompt (``decoded``: the output after it)."""
    if not token_ids:
        raise InvalidArgumentError("prefill.token_ids: empty prompt")
    if not 0 <= decoded < len(token_ids):
        raise InvalidArgumentError(f"prefill.decoded = {decoded}: must be in [0, {len(token_ids)}) "
                                   "(the output after a prompt of at least one token)")
    bad = next((t for t in [*token_ids, *([anchor] if anchor is not None else [])]
                if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgumentError(f"prefill.token_ids: token {bad} out of range [0, {vocab_size})")
    if len(token_ids) + 1 > max_context:
        raise LimitExceededError(f"prefill: {len(token_ids)} tokens exceed max_context {max_context}")


def check_verify_call(call: VerifyCall, session_base: int, anchor: int, limits: VerifierLimits,
                      chain_block: int) -> None:
    """What every verifier checks of a verify call before it changes anything: the base, the
    tree (shape, limits, vocabulary; rooted at the session's pending ``anchor``), the context
    it reaches, and its mask chains (``chain_block``: the self-draft adapter's block, 0 for a
    verifier without one)."""
    tree = call.tree
    check_base(call.session_id, session_base, call.base)
    try:
        tree.validate(limits.tree)
    except TreeLimitError as e:
        raise LimitExceededError(str(e)) from None
    except TreeError as e:
        raise InvalidArgumentError(str(e)) from None
    if tree.tokens[0] != anchor:
        raise InvalidArgumentError(
            f"tree.tokens[0] = {tree.tokens[0]}: the root must be the session's anchor {anchor}")
    if call.base + tree.max_depth + 2 > limits.max_context:
        raise LimitExceededError(
            f"verify: context {call.base + tree.max_depth + 1} would exceed max_context {limits.max_context}")
    if call.chains is not None:
        _check_chains(call.chains, tree, chain_block, limits.tree.vocab_size)


def _check_chains(chains: MaskChains, tree: TokenTree, chain_block: int, vocab_size: int | None) -> None:
    if not chain_block:
        raise InvalidArgumentError("verify.chains: this verifier has no self-draft adapter "
                                   "(`--drafter self:DIR` loads one)")
    if not 1 <= chains.depth <= chain_block:
        raise InvalidArgumentError(f"verify.chains.depth = {chains.depth}: must lie in "
                                   f"[1, {chain_block}] (the adapter's block)")
    if vocab_size is not None and not 1 <= chains.top_k <= vocab_size:
        raise InvalidArgumentError(f"verify.chains.top_k = {chains.top_k}: must lie in [1, {vocab_size}]")
    bad = next((u for u in chains.after if not 0 <= u < len(tree.tokens)), None)
    if bad is not None:
        raise InvalidArgumentError(f"verify.chains.after: node {bad} is not in the tree of "
                                   f"{len(tree.tokens)} nodes")
    if len(set(chains.after)) != len(chains.after):
        raise InvalidArgumentError("verify.chains.after: a node named twice")


def fit_chains(call: VerifyCall, max_context: int) -> MaskChains | None:
    """The call's chains, shortened to stay inside the context window (they only draft: a
    shorter chain drafts a shallower next block); None when none fits."""
    ch = call.chains
    if ch is None or not ch.after:
        return None
    room = max_context - 1 - call.base - max(call.tree.depths[u] for u in ch.after)
    return None if room < 1 else replace(ch, depth=min(ch.depth, room))
