"""``DFlashDrafter``: the in-process drafter engine over a ``DFlashDraftModel``.

Per session it keeps the context K/V of every draft layer, extended by each round's
feature delta, plus an online n-gram of the request's tokens for the n-gram rho. Those
K/V bytes are admitted against the session table's budget before they are computed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from presto_sd.embedded.memory import kv_bytes_per_token
from presto_sd.engine.drafter import CheckedDrafter, DraftCall, DrafterInfo, DraftResult, check_draft_call
from presto_sd.engine.messages import (
    EngineError,
    FeatureDelta,
    InvalidArgumentError,
    LimitExceededError,
    answer_of,
    check_base,
    check_once_per_batch,
)
from presto_sd.engine.sessions import SessionTable
from presto_sd.method.builders import build_tree
from presto_sd.method.methods import TREE_METHODS
from presto_sd.method.ngram import NGramModel
from presto_sd.method.scores import (
    ConstantRho,
    DraftMarginals,
    LookupProposalRho,
    NGramRho,
    PrefixProposalRho,
    PrefixRho,
    RhoProvider,
    ScoringContext,
)
from presto_sd.models.assets import DrafterDefaults
from presto_sd.models.dflash import DFlashDraftModel
from presto_sd.models.session_kv import SessionKV


@dataclass
class _DraftSession:
    kv: SessionKV  # every draft layer's context K/V, one entry per cached token
    tokens: list[int]  # tokens whose features are cached (positions 0..n-1)
    ngram: NGramModel
    last_used: float = field(default_factory=time.monotonic)

    @property
    def base(self) -> int:
        return len(self.tokens)

    @property
    def positions(self) -> int:  # context K/V positions cached
        return len(self.tokens)


class DFlashDrafter(CheckedDrafter):
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
        ngram = self.rho_providers["ngram"]
        if isinstance(ngram, NGramRho):  # the n-gram with the context's own lookup
            self.rho_providers["ngram-lookup"] = LookupProposalRho(ngram)
        if model.prefix_head is not None:  # the drafter's own prefix-conditioned estimate
            t2d = torch.full((self.vocab_size,), -1, dtype=torch.long, device=lm_head.device)
            d2t = self.d2t if self.d2t is not None else torch.arange(self.vocab_size, device=lm_head.device)
            t2d[d2t] = torch.arange(len(d2t), device=lm_head.device)
            head = model.prefix_head
            weights = (head.prev.weight, head.gate.weight, head.next)
            prefix = PrefixRho(self.draft_head, t2d, *(w.detach().float() for w in weights))
            self.rho_providers["prefix"] = prefix
            if isinstance(ngram, NGramRho):  # children from the head's conditional, the n-gram on top
                proposal = PrefixProposalRho(prefix, ngram)
                self.rho_providers["prefix-ngram"] = proposal
                # the head's children mixed with the request's own n-gram row
                self.rho_providers["prefix-lookup"] = LookupProposalRho(ngram, proposal, name="prefix-lookup")
        self.max_sessions = max_sessions
        self.name, self.defaults = name, defaults or DrafterDefaults()
        self.max_context = max_context
        self.max_budget = max_budget
        per_token = kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                       model.fc.weight.dtype)
        # the budget counts the bytes the sessions' buffers hold, growth room included
        self.sessions: SessionTable[_DraftSession] = SessionTable(
            "drafter", max_sessions, per_token, max_kv_bytes,
            held_bytes=lambda: sum(s.kv.nbytes for s in list(self.sessions.values())))

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

    @torch.inference_mode()  # the session's buffers are inference tensors: every write in this mode
    def prefill(self, session_id: str, delta: FeatureDelta, restart: bool = False) -> int:
        if delta.start != 0:
            raise InvalidArgumentError(f"prefill.delta.start = {delta.start}: must be 0")
        if not delta.tokens:
            raise InvalidArgumentError("prefill.delta: empty prompt")
        self._check_delta(delta)
        n = len(delta.tokens)
        seat = self.sessions.seat(session_id, SessionKV.private_capacity(n) * self.sessions.bytes_per_token,
                                  restart, f"a prefill of {n} tokens")
        try:
            ngram = NGramModel(order=3, vocab_size=self.vocab_size)
            ngram.update(list(delta.tokens))
            kv = self.model.session_kv(self.lm_head.device)
            kv.append(self._context_kv(delta))
            session = _DraftSession(kv, list(delta.tokens), ngram)
            self.sessions.open(seat, session)
        finally:
            self.sessions.release(seat)
        return session.base

    @torch.inference_mode()
    def commit(self, session_id: str, delta: FeatureDelta) -> int:
        s = self.sessions.touch(session_id)
        check_base(session_id, s.base, delta.start)
        if not delta.tokens:
            raise InvalidArgumentError("commit.delta.tokens: empty (a round commits at least its anchor)")
        self._check_delta(delta)
        self.sessions.admit(s.kv.growth_bytes(s.kv.length + len(delta.tokens)),
                            f"a commit of {len(delta.tokens)} tokens")
        s.kv.append(self._context_kv(delta))
        s.ngram.update(list(delta.tokens), history=s.tokens)
        s.tokens.extend(delta.tokens)
        return s.base

    # -- drafting -----------------------------------------------------------------------
    def marginals(self, session: _DraftSession, anchor: int, depth: int, top_k: int,
                  wide: int = 0) -> DraftMarginals:
        """One drafter forward over ``[anchor, MASK x (L-1)]``; top-K of the first ``depth``
        (and their top-``wide`` draft ids, for a prefix head's support)."""
        return self._marginals([(session, anchor, depth, top_k, wide)])[0]

    @torch.inference_mode()
    def _marginals(self, items: list[tuple[_DraftSession, int, int, int, int]]) -> list[DraftMarginals]:
        """Every (session, anchor, depth, top_k, wide)'s block in ONE drafter forward."""
        c = self.config
        block = torch.full((len(items), c.block_size), c.mask_token_id, dtype=torch.long)
        block[:, 0] = torch.tensor([anchor for _, anchor, *_ in items])
        embeds = self.embed_tokens[block].to(self.model.fc.weight.dtype)
        positions = torch.stack([torch.arange(s.base, s.base + c.block_size) for s, *_ in items])
        depth = max(d for _, _, d, *_ in items)
        hidden = self.model(embeds, positions, [s.kv for s, *_ in items])[:, 1 : depth + 1]
        rows = hidden.reshape(-1, hidden.shape[-1]).to(self.draft_head.dtype)  # one matmul for all
        logp = torch.log_softmax((rows @ self.draft_head.T).float(), dim=-1).view(len(items), depth, -1)
        out = []
        for r, (_, _, d, k, wide) in enumerate(items):
            m = DraftMarginals.top_of(logp[r, :d], min(k, logp.shape[-1]), hidden[r, :d].float(), wide)
            if self.d2t is not None:  # draft-vocabulary rows -> the target's token ids
                m = replace(m, token_ids=self.d2t[m.token_ids])
            out.append(m)
        return out

    def draft_batch(self, calls: Sequence[DraftCall]) -> list[DraftResult | EngineError]:
        """Every valid call's block in ONE drafter forward, then each call's tree.

        Each call is checked as ``draft`` checks it (a session named twice: INVALID_ARGUMENT
        for the later call); a refused call gets its error in its slot. A call's ``commit``
        applies only once the whole call passed its checks (drafting itself changes no
        session), so a refused call changes nothing.
        """
        out: list[DraftResult | EngineError | None] = [None] * len(calls)
        todo: list[tuple[int, _DraftSession, RhoProvider | None, bool, int]] = []
        seen: set[str] = set()
        for j, c in enumerate(calls):
            try:
                check_once_per_batch(seen, c.session_id, f"draft_batch.calls[{j}]")
                checked = self._check_draft(c)
                if c.commit is not None:
                    self.commit(c.session_id, c.commit)  # checks its delta before it changes anything
                todo.append((j, *checked))
            except EngineError as e:
                out[j] = answer_of(e)
        if not todo:
            return out
        t0 = time.perf_counter()
        # a prefix head's rho reads the top-M of each depth (``wide``): from the drafter's own top-k
        marginals = self._marginals([(s, calls[j].anchor, depth, calls[j].params.top_k,
                                      getattr(rho, "wide", 0)) for j, s, rho, _, depth in todo])
        forward_s = time.perf_counter() - t0
        for (j, s, rho, sizes_itself, _), m in zip(todo, marginals):
            try:
                out[j] = self._build(s, calls[j], m, rho, sizes_itself, forward_s)
            except EngineError as e:
                out[j] = answer_of(e)
        return out

    def _check_draft(self, c: DraftCall) -> tuple[_DraftSession, RhoProvider | None, bool, int]:
        """The session, rho, whether the method sizes itself, the depth; or the named error."""
        s = self.sessions.touch(c.session_id)
        method, rho = check_draft_call(c, s.base, self.vocab_size, self.max_budget, self.rho_providers)
        # a tree of B nodes is at most B deep: the block's later rows would be computed for nothing
        return s, rho, method.sizes_itself, min(c.params.depth, self.config.block_size - 1, c.params.budget)

    def _build(self, s: _DraftSession, c: DraftCall, marginals: DraftMarginals,
               rho: RhoProvider | None, sizes_itself: bool, forward_s: float) -> DraftResult:
        ctx = ScoringContext(marginals, s.tokens + [c.anchor], s.ngram)
        measured = c.context
        if sizes_itself and measured.draft_s <= 0:  # no estimate given: this round's forward
            measured = replace(measured, draft_s=forward_s)
        t0 = time.perf_counter()
        try:
            built = build_tree(c.method, c.anchor, ctx, c.params, rho, measured)
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from None
        return DraftResult(built.tree, marginals, built.path_scores, forward_s, time.perf_counter() - t0,
                           built.node_log_acceptance)
