"""Node scores: marginal ``log q`` and PRESTO's prefix-aligned ``log q + lambda_d log rho``.

``rho_d(t | c_d)`` estimates the probability that token ``t`` at depth ``d`` is accepted
given that its prefix ``c_d`` was. Providers are pluggable (``RhoProvider``): a constant,
an n-gram LM, or the learned ``h_phi`` MLP. Everything here is pure tensor code: the
drafter hands in its marginals, nothing else about models or transport.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from presto_sd.method.ngram import NGramModel

RHO_FLOOR = 1e-3  # rho is a probability estimate; never let one node veto a path outright


@dataclass(frozen=True)
class DraftMarginals:
    """The drafter's top-K per block position; row ``d - 1`` is depth ``d``."""

    token_ids: torch.Tensor  # long [D, K], best first
    log_probs: torch.Tensor  # float [D, K], log q_d (not renormalised over the top-K)
    entropy: torch.Tensor  # float [D], entropy of the full q_d
    hidden: torch.Tensor | None = None  # float [D, H], drafter output states (h_phi features)
    # the top-M (M >= K) of log q_d over the draft vocabulary, draft ids [D, M] and log q
    # [D, M], best first: a prefix head's support, from the drafter's own top-k (a second
    # lm_head matmul and top-k would cost ~0.6 ms a depth on a CPU)
    wide_ids: torch.Tensor | None = None
    wide_log_probs: torch.Tensor | None = None

    @property
    def depth(self) -> int:
        return self.token_ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.token_ids.shape[1]

    @classmethod
    def top_of(cls, log_probs: torch.Tensor, top_k: int, hidden: torch.Tensor | None = None,
               wide: int = 0) -> DraftMarginals:
        """The top-``top_k`` of full log-probs ``[D, V]`` (one row a depth), and each row's
        entropy; ``wide``: the top-``wide`` too (``wide_ids``), from the same top-k."""
        top = torch.topk(log_probs, min(max(top_k, wide), log_probs.shape[-1]), dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        ids, values = top.indices[:, :top_k], top.values[:, :top_k]
        if not wide:
            return cls(ids, values, entropy, hidden)
        return cls(ids, values, entropy, hidden, top.indices[:, :wide], top.values[:, :wide])

    def head(self, depth: int, top_k: int) -> DraftMarginals:
        """The first ``depth`` positions, their best ``top_k`` candidates."""
        def rows(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[:depth]
        return DraftMarginals(self.token_ids[:depth, :top_k], self.log_probs[:depth, :top_k],
                              self.entropy[:depth], rows(self.hidden), rows(self.wide_ids),
                              rows(self.wide_log_probs))


@dataclass
class ScoringContext:
    """What a rho provider may condition on beyond the candidate itself."""

    marginals: DraftMarginals
    context_tokens: list[int]  # committed tokens, ending with the anchor
    online_ngram: NGramModel | None = None  # counts from this request's own context
    memo: dict = field(default_factory=dict)  # per-draft values a provider computes once


class RhoProvider(Protocol):
    name: str

    def log_rho(
        self,
        ctx: ScoringContext,
        depth: int,
        prefixes: list[list[int]],
        candidates: torch.Tensor,
        log_q: torch.Tensor,
    ) -> torch.Tensor:
        """``log rho`` [P, C] for candidates [P, C] extending each drafted prefix (len d-1)."""
        ...


@dataclass
class ConstantRho:
    value: float = 0.5
    name: str = "constant"

    def log_rho(self, ctx, depth, prefixes, candidates, log_q) -> torch.Tensor:
        return torch.full(candidates.shape, math.log(self.value))


@dataclass
class NGramRho:
    """``rho = min(1, p_ng(t | c) / q_d(t))`` from the request's online counts and a table."""

    table: NGramModel | None = None
    table_weight: float = 0.5  # mixture weight of the shipped table vs the online counts
    name: str = "ngram"

    def log_rho(self, ctx, depth, prefixes, candidates, log_q) -> torch.Tensor:
        out = torch.empty(candidates.shape, device=log_q.device)
        # the most history any source conditions on: a node copies that, not the whole context
        keep = max((m.order - 1 for m in (ctx.online_ngram, self.table) if m is not None), default=0)
        recent = ctx.context_tokens[-keep:] if keep else []
        for i, prefix in enumerate(prefixes):
            history = recent + prefix
            cands = candidates[i].tolist()
            p = self._probs(ctx, history, cands).to(log_q.device)
            out[i] = torch.log(p.clamp_min(1e-12)) - log_q[i]
        return out.clamp(max=0.0, min=math.log(RHO_FLOOR))

    def _probs(self, ctx: ScoringContext, history: list[int], cands: list[int]) -> torch.Tensor:
        sources = [m for m in (ctx.online_ngram, self.table) if m is not None]
        if not sources:
            return torch.full((len(cands),), RHO_FLOOR)
        if len(sources) == 1:
            return sources[0].probs(history, cands)
        online, table = sources
        w = self.table_weight
        return (1 - w) * online.probs(history, cands) + w * table.probs(history, cands)


class HPhi(nn.Module):
    """The learned acceptance predictor: a 2-layer MLP on node features -> logit of rho.

    A linear path on the scalar features (``log q``, entropy, depth and, with
    ``n_scalars = 4``, the n-gram's ``log rho``) runs beside the MLP, so h_phi starts from
    — and can never do much worse than — a calibrated ``q`` (or q and n-gram together).
    """

    def __init__(
        self, hidden_size: int, embed_size: int, width: int = 256, dropout: float = 0.1, n_scalars: int = 3
    ) -> None:
        super().__init__()
        if n_scalars not in (3, 4):
            raise ValueError(f"h_phi: n_scalars = {n_scalars}: 3 (q, entropy, depth) or 4 (+ n-gram)")
        self.config = {"hidden_size": hidden_size, "embed_size": embed_size, "width": width,
                       "dropout": dropout, "n_scalars": n_scalars}
        self.n_scalars = n_scalars
        self.net = nn.Sequential(
            nn.Linear(hidden_size + 2 * embed_size + n_scalars, width), nn.SiLU(), nn.Dropout(dropout),
            nn.Linear(width, 1),
        )
        self.scalar = nn.Linear(n_scalars, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return (self.net(features) + self.scalar(features[..., -self.n_scalars :])).squeeze(-1)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, path / "h_phi.safetensors")
        (path / "h_phi.json").write_text(json.dumps(self.config, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> HPhi:
        path = Path(path)
        model = cls(**json.loads((path / "h_phi.json").read_text()))
        model.load_state_dict(load_file(path / "h_phi.safetensors"))
        return model.eval()


def hphi_features(
    hidden: torch.Tensor,
    parent_emb: torch.Tensor,
    cand_emb: torch.Tensor,
    log_q: torch.Tensor,
    entropy: torch.Tensor,
    depth: torch.Tensor,
    log_rho_ngram: torch.Tensor | None = None,
) -> torch.Tensor:
    """Feature rows [..., H + 2E + 3 (+1)] for ``HPhi``; all leading shapes must broadcast."""
    lead = log_q.shape
    cols = [
        hidden.expand(*lead, hidden.shape[-1]),
        parent_emb.expand(*lead, parent_emb.shape[-1]),
        cand_emb.expand(*lead, cand_emb.shape[-1]),
        log_q[..., None],
        entropy.expand(lead)[..., None],
        (depth.float() / 16.0).expand(lead)[..., None],
    ]
    if log_rho_ngram is not None:  # the n-gram's view of the prefix: what q cannot see
        cols.append(log_rho_ngram.float().expand(lead)[..., None])
    return torch.cat(cols, dim=-1)


@dataclass
class LearnedRho:
    """``rho = sigmoid(h_phi(features))``; needs the target's token embeddings, and the
    n-gram provider when h_phi was trained with its ``log rho`` as a feature."""

    model: HPhi
    embed_tokens: torch.Tensor  # [V, E]
    ngram: NGramRho | None = None
    name: str = "hphi"
    _dtype: torch.dtype = field(default=torch.float32, repr=False)

    def __post_init__(self) -> None:
        if self.model.n_scalars == 4 and self.ngram is None:
            raise ValueError("this h_phi reads the n-gram's log rho: give LearnedRho an NGramRho")

    @torch.no_grad()
    def log_rho(self, ctx, depth, prefixes, candidates, log_q) -> torch.Tensor:
        m = ctx.marginals
        if m.hidden is None:
            raise ValueError("the h_phi rho provider needs the drafter's hidden states")
        parents = torch.tensor(
            [p[-1] if p else ctx.context_tokens[-1] for p in prefixes], dtype=torch.long
        )
        log_rho_ngram = None
        if self.model.n_scalars == 4:
            log_rho_ngram = self.ngram.log_rho(ctx, depth, prefixes, candidates, log_q)
        feats = hphi_features(
            m.hidden[depth - 1].float()[None, None],
            self.embed_tokens[parents].float()[:, None],
            self.embed_tokens[candidates].float(),
            log_q.float(),
            m.entropy[depth - 1].float(),
            torch.tensor(depth),
            log_rho_ngram,
        )
        logits = self.model(feats)
        return torch.nn.functional.logsigmoid(logits).clamp(min=math.log(RHO_FLOOR))


@dataclass
class PrefixRho:
    """``rho = q_d(t | x)``: the drafter's own block position ``d`` conditioned on the
    token ``x`` of the node's parent, from its prefix-conditioned head.

    A node is accepted exactly when its token is the target's next one given its
    (accepted) parent, so the conditional is a direct estimate of that probability: it
    rescores PRESTO's children and is TAPS's ``a(u)``. The head (``PrefixHead`` in
    ``models/dflash.py``) corrects position ``d``'s logits by ``next[t] . (prev[x] * (1 +
    gate h_d))``; its weights come in float32 (small matmuls in bf16 cost ~10x on a CPU).
    ``draft_head`` is the draft lm_head rows; ``t2d`` maps target ids to draft ids (-1
    outside the draft vocabulary).

    The head corrects only the marginal's top-``support`` tokens at a depth: the whole
    draft vocabulary would read all of ``next`` for every node (~0.4 ms a node on a 2-core
    CPU: more than the tau it buys at budget 4); a token outside keeps its marginal mass in
    the normaliser and is never proposed.
    """

    draft_head: torch.Tensor  # [Vd, H]
    t2d: torch.Tensor  # long [V]
    prev: torch.Tensor  # float [Vd + 1, R]: the parent's row (the last: a parent outside)
    gate: torch.Tensor  # float [R, H]
    next: torch.Tensor  # float [Vd, R]
    name: str = "prefix"
    support: int = 256
    d2t: torch.Tensor = field(init=False, repr=False)  # long [Vd]: t2d's inverse
    _prev_row: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ids = self.t2d.ge(0).nonzero()[:, 0]
        self.d2t = torch.full((self.draft_head.shape[0],), -1, dtype=torch.long, device=ids.device)
        self.d2t[self.t2d[ids]] = ids
        if bool((self.d2t < 0).any()):
            raise ValueError("PrefixRho: t2d must map a target id to every draft id")
        # a target id's row of ``prev`` (the last: outside the draft vocabulary), as Python ints:
        # one index a node instead of three small tensor ops
        self._prev_row = torch.where(self.t2d < 0, len(self.prev) - 1, self.t2d).tolist()

    @property
    def wide(self) -> int:
        """How many of the marginal's best draft ids it reads a depth (``DraftMarginals.wide_ids``)."""
        return self.support

    @torch.inference_mode()
    def conditional(self, ctx: ScoringContext, depth: int,
                    prefixes: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The support's draft ids [M] and ``log q_d(. | parent)`` over them [P, M], a row a prefix."""
        ids, log_q, next_rows, rest = self._depth_share(ctx, depth)
        rows = [self._prev_row[p[-1] if p else ctx.context_tokens[-1]] for p in prefixes]
        cond = log_q + self.prev[rows] @ next_rows.T
        return ids, cond - torch.logaddexp(torch.logsumexp(cond, dim=-1, keepdim=True), rest)

    def _depth_share(self, ctx: ScoringContext, depth: int) -> tuple[torch.Tensor, ...]:
        """A depth's support ids [M], their marginal log q [M], the head's ``next`` rows gated
        by the depth's hidden state [M, R] and the log mass outside the support: once a
        round and depth (a small tree never reads its block's later depths)."""
        key = ("prefix-support", id(self), depth)  # this head's: another provider may score the round
        if key in ctx.memo:
            return ctx.memo[key]
        m = ctx.marginals
        if m.hidden is None:
            raise ValueError("the prefix rho provider needs the drafter's hidden states")
        h = m.hidden[depth - 1].float()  # [H]
        width = min(self.support, self.draft_head.shape[0])
        if m.wide_ids is not None and m.wide_ids.shape[-1] >= width:  # the drafter's own top-M
            ids, log_q = m.wide_ids[depth - 1, :width], m.wide_log_probs[depth - 1, :width].float()
        else:
            full = torch.log_softmax((h.to(self.draft_head.dtype) @ self.draft_head.T).float(), dim=-1)
            log_q, ids = torch.topk(full, width)
        rest = (1 - log_q.exp().sum()).clamp_min(0).log()  # the mass outside the support
        next_rows = self.next[ids] * (1 + h @ self.gate.T)  # [M, R]
        ctx.memo[key] = share = (ids, log_q, next_rows, rest)
        return share

    def log_rho(self, ctx, depth, prefixes, candidates, log_q) -> torch.Tensor:
        ids, logp = self.conditional(ctx, depth, prefixes)  # [M], [P, M]
        where = torch.full((len(self.d2t),), -1, dtype=torch.long, device=ids.device)
        where[ids] = torch.arange(len(ids), device=ids.device)
        cand = self.t2d[candidates]  # [P, C]; outside the draft vocabulary: q = 0
        col = torch.where(cand >= 0, where[cand.clamp_min(0)], -1)  # outside the support: the floor
        floor = math.log(RHO_FLOOR)
        return logp.gather(1, col.clamp_min(0)).clamp(min=floor).masked_fill(col < 0, floor)


@dataclass
class PrefixProposalRho:
    """Children drawn from the prefix head's conditional, scored by the n-gram against it.

    ``PrefixRho`` rescores the marginal's top-K, the same candidates at every node of a
    depth; here each node's children are the top-K of ``q_d(. | its parent token)`` with
    that conditional as their ``log q``, and ``rho = min(1, p_ng / q_d(t | parent))`` (the
    n-gram sees the whole drafted prefix, the head only the parent). With ``lambda = 0`` a
    tree is best-first on the conditional alone. Under TAPS, ``a(u)`` is that n-gram rho (as
    with ``--taps-rho ngram``), over the head's candidates; TAPS's default stays ``hphi``.
    """

    prefix: PrefixRho
    ngram: NGramRho
    name: str = "prefix-ngram"

    @property
    def wide(self) -> int:
        return self.prefix.wide

    def propose(self, ctx: ScoringContext, depth: int, prefixes: list[list[int]],
                top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate target ids [P, K] and their ``log q_d(t | parent)`` [P, K], best first."""
        ids, logp = self.prefix.conditional(ctx, depth, prefixes)
        top = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
        return self.prefix.d2t[ids[top.indices]], top.values

    def log_rho(self, ctx, depth, prefixes, candidates, log_q) -> torch.Tensor:
        return self.ngram.log_rho(ctx, depth, prefixes, candidates, log_q)


@dataclass
class LookupProposalRho:
    """The marginal's top-K with the request's own n-gram (prompt lookup) folded in.

    At each node the online n-gram's longest seen history (at least ``min_history`` tokens
    of the context and the drafted path) names a next-token row; the node's proposal is the
    mixture ``q' = (1 - mix) q + mix p_row`` (``p_row``: that row's counts, normalised), and
    the row's best token, when the top-K lacks it, takes the last slot (its ``q`` counted
    0: it lies below the K-th). ``rho = min(1, p_ng / q')`` is the n-gram rho against
    ``q'``. Without a row, or with ``mix = 0``, it is ``ngram``. What a context repeats
    (code's names, a question's numbers, a list's structure) is proposed at any depth, where
    the marginal has no way to know which of its guesses the path above already wrote.
    """

    ngram: NGramRho
    base: PrefixProposalRho | None = None  # whose candidates it mixes (None: the marginal's top-K)
    mix: float = 0.5
    min_history: int = 2
    name: str = "ngram-lookup"

    @property
    def wide(self) -> int:
        return 0 if self.base is None else self.base.wide

    def __post_init__(self) -> None:
        if not 0.0 <= self.mix < 1.0:
            raise ValueError(f"ngram-lookup: mix = {self.mix} must be in [0, 1) (1 leaves the drafter out)")

    def propose(self, ctx: ScoringContext, depth: int, prefixes: list[list[int]],
                top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate target ids [P, K] and their mixture ``log q'`` [P, K], best first."""
        m = ctx.marginals
        if self.base is not None:
            all_ids, all_q = self.base.propose(ctx, depth, prefixes, top_k)
        else:
            ids, log_q = m.token_ids[depth - 1, :top_k], m.log_probs[depth - 1, :top_k].float()
            all_ids, all_q = ids.expand(len(prefixes), -1), log_q.expand(len(prefixes), -1)
        ng = ctx.online_ngram
        keep = 0 if ng is None else ng.order - 1  # the most history a row can condition on
        rows_ids, rows_q = [], []
        for prefix, ids, log_q in zip(prefixes, all_ids, all_q):
            row = self._row(ng, (ctx.context_tokens[-keep:] + prefix)[-keep:]) if self.mix and keep else None
            if row is None:
                rows_ids.append(ids)
                rows_q.append(log_q)
                continue
            counts, total = row
            cands = ids.tolist()
            best = max(counts, key=counts.get)
            log_q = log_q.clone()
            if best not in cands:  # the row's best takes the last slot, its q counted 0
                cands[-1] = best
                log_q[-1] = -math.inf
            p_row = torch.tensor([counts.get(t, 0) / total for t in cands], device=log_q.device)
            # in log space: a top-K candidate's q may underflow float32, never its mixture
            mixed = torch.logaddexp(log_q + math.log1p(-self.mix), p_row.log() + math.log(self.mix))
            order = torch.argsort(mixed, descending=True, stable=True)
            rows_ids.append(torch.tensor(cands, device=ids.device)[order])
            rows_q.append(mixed[order])
        return torch.stack(rows_ids), torch.stack(rows_q)

    def log_rho(self, ctx, depth, prefixes, candidates, log_q) -> torch.Tensor:
        return self.ngram.log_rho(ctx, depth, prefixes, candidates, log_q)

    def _row(self, ng: NGramModel, history: list[int]) -> tuple[dict[int, int], int] | None:
        """The longest seen history's next-token counts and their total; None under ``min_history``."""
        for k in range(min(ng.order - 1, len(history)), self.min_history - 1, -1):
            h = tuple(history[-k:])
            total = ng.totals[k].get(h, 0)
            if total:
                return ng.counts[k][h], total
        return None


def prefix_aligned_scores(
    log_q: torch.Tensor, log_rho: torch.Tensor, lam: float
) -> torch.Tensor:
    """PRESTO's node score ``s = log q + lambda_d log rho``."""
    return log_q + lam * log_rho
