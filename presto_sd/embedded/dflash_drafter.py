"""``DFlashDrafter``: the in-process drafter engine over a ``DFlashDraftModel``.

Per session it keeps the context K/V of every draft layer, extended by each round's
feature delta, plus an online n-gram of the request's tokens for the n-gram rho. Those
K/V bytes are admitted against the session table's budget before they are computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from presto_sd.embedded.memory import kv_bytes_per_token
from presto_sd.engine.drafter import Drafter, DrafterInfo, DraftResult
from presto_sd.engine.messages import (
    FeatureDelta,
    InvalidArgumentError,
    LimitExceededError,
    check_base,
)
from presto_sd.engine.sessions import SessionTable
from presto_sd.method.builders import TreeParams, build_tree
from presto_sd.method.methods import TREE_METHODS, get_method
from presto_sd.method.ngram import NGramModel
from presto_sd.method.scores import (
    ConstantRho,
    DraftMarginals,
    NGramRho,
    PrefixRho,
    RhoProvider,
    ScoringContext,
)
from presto_sd.models.assets import DrafterDefaults
from presto_sd.models.dflash import DFlashDraftModel


@dataclass
class _DraftSession:
    ctx_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [1, kv_heads, n, hd]
    tokens: list[int]  # tokens whose features are cached (positions 0..n-1)
    ngram: NGramModel
    last_used: float = field(default_factory=time.monotonic)

    @property
    def base(self) -> int:
        return len(self.tokens)

    @property
    def positions(self) -> int:  # context K/V positions cached
        return len(self.tokens)


class DFlashDrafter(Drafter):
    def __init__(
        self,
        model: DFlashDraftModel,
        embed_tokens: torch.Tensor,  # the target's [V, H]
        lm_head: torch.Tensor,  # the target's [V, H]
        rho_providers: dict[str, RhoProvider] | None = None,
        max_sessions: int = 256,
        max_context: int = 8192,
        max_budget: int = 1024,  # draft nodes per tree: bounds the tree building work
        name: str = "",  # what Info calls it: the drafter directory, or "random"
        defaults: DrafterDefaults | None = None,  # the PRESTO settings fitted for it (presto.json)
        max_kv_bytes: int | None = None,  # the sessions' context K/V budget (None: no budget)
    ) -> None:
        c = model.config
        if embed_tokens.shape[1] != c.hidden_size or lm_head.shape[1] != c.hidden_size:
            raise ValueError(
                f"target embeddings {tuple(embed_tokens.shape)} / lm_head {tuple(lm_head.shape)} "
                f"do not match the drafter's hidden size {c.hidden_size}"
            )
        self.model = model.eval()
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        # a reduced draft vocabulary drafts from the target's rows lm_head[d2t] only
        self.d2t = model.d2t.to(lm_head.device) if model.d2t is not None else None
        self.draft_head = lm_head[self.d2t] if self.d2t is not None else lm_head
        self.vocab_size = lm_head.shape[0]
        self.rho_providers: dict[str, RhoProvider] = {
            "constant": ConstantRho(),
            "ngram": NGramRho(),
            **(rho_providers or {}),
        }
        if model.prefix_head is not None:  # the drafter's own prefix-conditioned estimate
            t2d = torch.full((self.vocab_size,), -1, dtype=torch.long, device=lm_head.device)
            d2t = self.d2t if self.d2t is not None else torch.arange(self.vocab_size, device=lm_head.device)
            t2d[d2t] = torch.arange(len(d2t), device=lm_head.device)
            head = model.prefix_head
            self.rho_providers["prefix"] = PrefixRho(
                self.draft_head, t2d, lambda h, parent: head(h.to(head.next.dtype), parent))
        self.max_sessions = max_sessions
        self.name, self.defaults = name, defaults or DrafterDefaults()
        self.max_context = max_context
        self.max_budget = max_budget
        per_token = kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                       model.fc.weight.dtype)
        self.sessions: SessionTable[_DraftSession] = SessionTable("drafter", max_sessions, per_token,
                                                                  max_kv_bytes)

    @property
    def config(self):
        return self.model.config

    def info(self) -> DrafterInfo:
        c = self.config
        return DrafterInfo(
            block_size=c.block_size,
            target_layer_ids=c.target_layer_ids,
            mask_token_id=c.mask_token_id,
            vocab_size=self.vocab_size,
            methods=TREE_METHODS,
            rho_providers=tuple(self.rho_providers),
            name=self.name,
            defaults=self.defaults,
            max_sessions=self.max_sessions,
            memory=self.sessions.memory(),
        )

    def close(self, session_id: str) -> None:
        self.sessions.close(session_id)

    def close_idle(self, ttl_s: float) -> list[str]:
        return self.sessions.close_idle(ttl_s)

    # -- context cache ------------------------------------------------------------------
    def _check_delta(self, delta: FeatureDelta) -> None:
        width = len(self.config.target_layer_ids) * self.config.hidden_size
        if delta.features.shape[1] != width:
            raise InvalidArgumentError(
                f"delta.features: width {delta.features.shape[1]}, expected {width} "
                f"({len(self.config.target_layer_ids)} layers x {self.config.hidden_size})"
            )
        bad = next((t for t in delta.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError(f"delta.tokens: token {bad} out of range [0, {self.vocab_size})")
        if delta.end > self.max_context:
            raise LimitExceededError(f"drafter: context {delta.end} exceeds {self.max_context}")

    @torch.inference_mode()
    def _context_kv(self, delta: FeatureDelta):
        dtype = self.model.fc.weight.dtype
        feats = delta.features.to(dtype)[None]
        positions = torch.arange(delta.start, delta.end)[None]
        return self.model.context_kv(feats, positions)

    def prefill(self, session_id: str, delta: FeatureDelta, restart: bool = False) -> int:
        if delta.start != 0:
            raise InvalidArgumentError(f"prefill.delta.start = {delta.start}: must be 0")
        if not delta.tokens:
            raise InvalidArgumentError("prefill.delta: empty prompt")
        self._check_delta(delta)
        seat = self.sessions.seat(session_id, len(delta.tokens), restart)
        try:
            ngram = NGramModel(order=3, vocab_size=self.vocab_size)
            ngram.update(list(delta.tokens))
            session = _DraftSession(self._context_kv(delta), list(delta.tokens), ngram)
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
        self.sessions.admit(len(delta.tokens), f"a commit of {len(delta.tokens)} tokens")
        new = self._context_kv(delta)
        s.ctx_kv = [
            (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
            for (k, v), (nk, nv) in zip(s.ctx_kv, new)
        ]
        s.ngram.update(list(delta.tokens), history=s.tokens)
        s.tokens.extend(delta.tokens)
        return s.base

    # -- drafting -----------------------------------------------------------------------
    @torch.inference_mode()
    def marginals(self, session: _DraftSession, anchor: int, depth: int, top_k: int) -> DraftMarginals:
        """One drafter forward over ``[anchor, MASK x (L-1)]``; top-K of the first ``depth``."""
        c = self.config
        n = session.base
        block = torch.full((1, c.block_size), c.mask_token_id, dtype=torch.long)
        block[0, 0] = anchor
        embeds = self.embed_tokens[block].to(self.model.fc.weight.dtype)
        positions = torch.arange(n, n + c.block_size)[None]
        hidden = self.model(embeds, positions, session.ctx_kv)[0, 1 : depth + 1]
        logp = torch.log_softmax((hidden.to(self.draft_head.dtype) @ self.draft_head.T).float(), dim=-1)
        top = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        ids = self.d2t[top.indices] if self.d2t is not None else top.indices
        return DraftMarginals(ids, top.values, entropy, hidden.float())

    def draft(self, session_id: str, anchor: int, base: int, params: TreeParams) -> DraftResult:
        s = self.sessions.touch(session_id)
        check_base(session_id, s.base, base)
        if not 0 <= anchor < self.vocab_size:
            raise InvalidArgumentError(f"draft.anchor = {anchor}: out of range [0, {self.vocab_size})")
        if params.budget > self.max_budget:
            raise LimitExceededError(
                f"tree.budget = {params.budget}: over the drafter's limit {self.max_budget}"
            )
        try:
            rho, method = None, get_method(params.method, "tree.method")
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from None
        # TAPS may take its acceptance from q itself: rho "marginal"
        if method.uses_rho and not (method.sizes_itself and params.rho == "marginal"):
            rho = self.rho_providers.get(params.rho)
            if rho is None:
                raise InvalidArgumentError(
                    f"tree.rho = {params.rho!r}: unknown (have {', '.join(self.rho_providers)})"
                )
        depth = min(params.depth, self.config.block_size - 1)
        t0 = time.perf_counter()
        marginals = self.marginals(s, anchor, depth, params.top_k)
        t1 = time.perf_counter()
        ctx = ScoringContext(marginals, s.tokens + [anchor], s.ngram)
        if method.sizes_itself and params.draft_s <= 0:  # no estimate given: this round's
            params = replace(params, draft_s=t1 - t0)
        try:
            built = build_tree(anchor, ctx, params, rho)
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from None
        t2 = time.perf_counter()
        return DraftResult(built.tree, marginals, built.path_scores, t1 - t0, t2 - t1,
                           built.node_log_acceptance)
