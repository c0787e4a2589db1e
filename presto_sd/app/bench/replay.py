"""Offline tau replay: what every tree builder would accept, without running the target.

Greedy verification is deterministic: what a tree accepts at committed position ``n``
depends only on the tree and the target's greedy continuation. So one recorded AR pass
per prompt (the target's tokens, and the feature deltas a real run hands the drafter)
stands in for the target: ``OracleVerifier`` answers ``verify`` by walking the tree
against the recorded continuation, and the real generation loop runs the real drafter
against it. Every round is therefore built at its own position, before later tokens are
committed (the online n-gram never sees the future), and the loop's renewal walk (a
round at ``n`` commits ``a + 1`` tokens; the next starts after them) is the loop itself:
the tau it reports is the tau ``bench`` measures, at the cost of drafting only.

Besides the walk, ``position_stats`` drafts once at *every* position of the recording
and reports the drafter's recall@K per depth and the oracle accepted length over its
top-K (the longest prefix of the continuation whose every token is in the top-K at its
depth: what a tree holding all top-K combinations would accept).

Timing-driven methods (``taps``, whose budgets follow the verify cost it observes) and
sampling have no replay: the oracle's verify costs nothing and knows one continuation.

The self-speculative mode (``self-*`` methods) replays too: on the recorded continuation
the chain after position ``q`` sees exactly the context it sees online (greedy commits the
recording), so ``self_draft_blocks`` drafts every position's chain in one teacher-forced
pass (the training arithmetic, ``mask_chain_forward``: the serving kernels' values within
rounding), and the oracle hands the one after the walk's last node back as the round's
``next_block``, as the verify forward does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch
from tqdm import tqdm

from presto_sd.app.bench.methods import SELF, BenchContext
from presto_sd.app.bench.runner import BenchConfig, BenchPrompt, Job, run_one
from presto_sd.app.bench.stats import RunLog
from presto_sd.app.errors import FlagError
from presto_sd.engine.drafter import Drafter
from presto_sd.engine.messages import FeatureDelta, InvalidArgumentError, SessionNotFoundError, check_base
from presto_sd.engine.verifier import MaskChains, PrefillResult, Verifier, VerifierInfo, VerifyResult
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.builders import TreeParams
from presto_sd.method.scores import DraftMarginals
from presto_sd.method.tree import TokenTree

# Methods whose rounds depend on measured time, not only on trees and tokens.
NOT_REPLAYABLE = frozenset({"taps", "hf-generate", "hf-prompt-lookup", "llama-cpp"})


@dataclass(frozen=True)
class Recording:
    """One prompt's greedy AR pass: the continuation and every token's features."""

    prompt: tuple[int, ...]
    continuation: tuple[int, ...]  # greedy tokens after the prompt (past any EOS)
    features: torch.Tensor  # [len(prompt) + len(continuation) - 1, F]: every fed token's

    @cached_property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt + self.continuation


def recording_key(prompt: BenchPrompt) -> str:
    """Where a prompt's recording sits in a recordings file."""
    return f"{prompt.dataset}/{prompt.id}"


def record(
    verifier: Verifier, prompt: Sequence[int], new_tokens: int, session_id: str = "replay"
) -> Recording:
    """Greedy AR decoding of ``new_tokens`` tokens with the verifier's own prefill and steps.

    The features are the deltas a real run's drafter receives (prefill, then one per
    step), so the drafter sees what it would see online. No stop ids: a tree may accept
    past an EOS before the loop truncates, so the oracle must know what follows it.
    """
    pre = verifier.prefill(session_id, list(prompt), SamplingParams())
    try:
        cont, feats, base, anchor = [pre.anchor], [pre.delta.features], pre.base, pre.anchor
        while len(cont) < new_tokens:
            res = verifier.step(session_id, base, anchor)
            feats.append(res.delta.features)
            cont.append(res.bonus)
            base, anchor = res.base, res.bonus
    finally:
        verifier.close(session_id)
    return Recording(tuple(prompt), tuple(cont), torch.cat(feats).float())


@dataclass
class OracleVerifier(Verifier):
    """A verifier that knows the target's greedy continuation of one recorded prompt."""

    recording: Recording
    target_info: VerifierInfo
    bases: dict[str, int] = field(default_factory=dict)  # session -> committed length
    # self-* methods: the chain drafted after each position of the recording
    chain_blocks: dict[int, DraftMarginals] = field(default_factory=dict)

    def info(self) -> VerifierInfo:
        return self.target_info

    def _delta(self, start: int, end: int) -> FeatureDelta:
        r = self.recording
        if end > len(r.features):
            raise InvalidArgumentError(
                f"replay: position {end} is past the recording ({len(r.features)} fed tokens); "
                "record more tokens"
            )
        return FeatureDelta(start, r.tokens[start:end], r.features[start:end])

    def prefill(self, session_id, token_ids, sampling=SamplingParams(), anchor=None,
                restart=False, decoded=0) -> PrefillResult:
        r = self.recording
        if sampling.temperature != 0:
            raise InvalidArgumentError("replay: greedy only (sampled acceptance is not deterministic)")
        if tuple(token_ids) != r.prompt or (anchor is not None and anchor != r.continuation[0]):
            raise InvalidArgumentError("replay: this oracle knows only its recorded prompt")
        self.bases[session_id] = len(r.prompt)
        return PrefillResult(r.continuation[0], self._delta(0, len(r.prompt)), len(r.prompt))

    def verify(self, session_id, base, tree: TokenTree, want_node_probs=False,
               chains: MaskChains | None = None) -> VerifyResult:
        if session_id not in self.bases:
            raise SessionNotFoundError(f"replay: unknown session {session_id!r}")
        check_base(session_id, self.bases[session_id], base)
        seq = self.recording.tokens
        node, accepted, path = 0, [], [0]
        while True:  # greedy walk: follow the child carrying the target's next token
            nxt = base + len(accepted) + 1
            if nxt >= len(seq):
                raise InvalidArgumentError(f"replay: position {nxt} is past the recording; record more")
            child = next((c for c in tree.children(node) if tree.tokens[c] == seq[nxt]), None)
            if child is None:
                break
            accepted.append(seq[nxt])
            path.append(child)
            node = child
        new_base = base + len(accepted) + 1
        delta = self._delta(base, new_base)
        block = self.chain_blocks.get(new_base - 1)  # none past the recording: a root-only round next
        if chains is not None and path[-1] in chains.after and block is not None:
            delta = replace(delta, next_block=block.head(chains.depth, chains.top_k))
        self.bases[session_id] = new_base
        return VerifyResult(tuple(accepted), seq[new_base], delta, new_base, None, tuple(path))

    def close(self, session_id: str) -> None:
        self.bases.pop(session_id, None)


def replay_jobs(config: BenchConfig) -> list[Job]:
    return [j for j in config.jobs()
            if j.method.removeprefix(SELF) not in NOT_REPLAYABLE and j.method != "ar"]


@torch.no_grad()
def self_draft_blocks(verifier, recording: Recording, first: int, n: int, depth: int,
                      top_k: int, chunk: int = 64) -> dict[int, DraftMarginals]:
    """The chain of ``depth`` mask rows after each position ``first .. first + n - 1`` of the
    recording, teacher-forced in one target pass (``verifier``: an ``HFVerifier`` with a
    self-draft adapter): position -> its top-``top_k`` marginals."""
    from presto_sd.models.self_draft import mask_chain_forward, real_pass

    model, adapter = verifier.model, verifier.adapter
    last = min(first + n, len(recording.tokens) - 1)
    _, kv = real_pass(model, torch.tensor([recording.tokens[:last]], device=model.device))
    out: dict[int, DraftMarginals] = {}
    for start in range(first, last, chunk):
        hang = torch.arange(start, min(start + chunk, last), device=model.device)
        hidden = mask_chain_forward(model, adapter, kv, hang[None], depth)[0]
        logp = torch.log_softmax(verifier.runner.logits(hidden), dim=-1).view(len(hang), depth, -1).cpu()
        for i, q in enumerate(hang.tolist()):
            out[q] = DraftMarginals.top_of(logp[i], top_k)
    return out


def replay_bench(
    verifier: Verifier,
    drafter: Drafter,
    prompts: Sequence[BenchPrompt],
    config: BenchConfig,
    progress: bool = True,
    recordings: dict[str, Recording] | None = None,
    self_drafter: Drafter | None = None,
) -> tuple[list[RunLog], dict[str, Recording]]:
    """Every replayable job of ``config`` on every prompt; one ``RunLog`` each (its times are
    the drafter's alone: the oracle's verify costs nothing). ``self_drafter``: the self-*
    jobs' (``verifier`` then carries the adapter that drafts their chains)."""
    if not config.greedy:
        raise FlagError("replay: greedy only (--temperature 0)")
    jobs = replay_jobs(config)
    if not jobs:
        raise FlagError(f"replay: nothing to replay among {config.methods} (not: {sorted(NOT_REPLAYABLE)})")
    recordings = dict(recordings or {})
    depth = max(config.job_params(j, 0).tree.depth for j in jobs)
    logs: list[RunLog] = []
    bar = tqdm(total=len(prompts) * (len(jobs) + 1), desc="replay", unit="gen", disable=not progress)
    try:
        for i, prompt in enumerate(prompts):
            key, needed = recording_key(prompt), config.params.max_new_tokens + depth + 1
            if key not in recordings or len(recordings[key].continuation) < needed:  # none, or too short
                recordings[key] = record(verifier, prompt.token_ids, needed)
            bar.update()
            oracle = OracleVerifier(recordings[key], verifier.info())
            if any(j.method.startswith(SELF) for j in jobs):
                if self_drafter is None:
                    raise FlagError("replay: the self-* methods need a self-draft adapter (--self-draft)")
                chain = min(depth, self_drafter.info().block_size - 1)
                oracle.chain_blocks = self_draft_blocks(verifier, recordings[key], len(prompt.token_ids) - 1,
                                                        config.params.max_new_tokens + depth + 1, chain,
                                                        config.params.tree.top_k)
            ctx = BenchContext(oracle, drafter, self_drafter=self_drafter)
            for job in jobs:
                logs.append(run_one(ctx, prompt, job, config.job_params(job, i)))
                bar.update()
    finally:
        bar.close()
    return logs, recordings


@dataclass
class PositionStats:
    """Per-position drafter quality over a set of recordings (positions = committed tokens)."""

    top_k: int
    depth: int
    positions: int = 0
    hits: torch.Tensor = field(init=False)  # [D, K] count of "target token is the drafter's k-th"
    oracle_len: list[int] = field(default_factory=list)  # per position, accepted over all top-K
    top1_len: list[int] = field(default_factory=list)  # per position, accepted by the top-1 chain
    # with a prefix head: [D, 2] counts of "target token is the conditional's top-1 / in its
    # top-K" given the true parent token (what a tree node's children are scored with)
    cond_hits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.hits = torch.zeros(self.depth, self.top_k, dtype=torch.long)

    def recall(self, k: int) -> list[float]:
        """recall@k per depth: the share of positions whose target token is in the top-k."""
        return [round(float(self.hits[d, :k].sum()) / max(1, self.positions), 4) for d in range(self.depth)]

    def summary(self) -> dict[str, Any]:
        ks = sorted({1, 2, 4, 8, self.top_k} & set(range(1, self.top_k + 1)))
        n = max(1, len(self.oracle_len))
        out = {"positions": self.positions, "top_k": self.top_k,
               "recall": {str(k): self.recall(k) for k in ks},
               "oracle_accept_mean": round(sum(self.oracle_len) / n, 4),
               "top1_accept_mean": round(sum(self.top1_len) / n, 4)}
        if self.cond_hits is not None:
            share = (self.cond_hits.float() / max(1, self.positions)).round(decimals=4)
            out["prefix_recall"] = {"1": share[:, 0].tolist(), str(self.top_k): share[:, 1].tolist()}
        return out


def position_stats(
    drafter: Drafter, recordings: Sequence[Recording], new_tokens: int, top_k: int = 16,
    progress: bool = True,
) -> PositionStats:
    """Draft at every position of each recording's first ``new_tokens`` (one token committed at a time)."""
    depth = drafter.info().block_size - 1
    stats = PositionStats(top_k, depth)
    prefix = getattr(drafter, "rho_providers", {}).get("prefix")  # an in-process drafter's head
    if prefix is not None:
        stats.cond_hits = torch.zeros(depth, 2, dtype=torch.long)
        vocab = prefix.t2d.ge(0).nonzero()[:, 0]  # every draftable target id
    params = TreeParams(budget=depth, depth=depth, top_k=top_k)
    bar = tqdm(total=len(recordings) * new_tokens, desc="positions", unit="pos", disable=not progress)
    for r in recordings:
        seq, p = r.tokens, len(r.prompt)
        sid = "replay-positions"
        drafter.prefill(sid, FeatureDelta(0, r.prompt, r.features[:p]))
        try:
            for n in range(p, min(p + new_tokens, len(seq) - depth - 1)):
                m = drafter.draft(sid, seq[n], n, "linear", params).marginals
                truth = torch.tensor(seq[n + 1 : n + 1 + m.depth])
                match = m.token_ids[:, :top_k] == truth[:, None]  # [D, K]
                stats.hits[: m.depth] += match.long()
                stats.positions += 1
                in_top = match.any(-1).tolist() + [False]
                stats.oracle_len.append(in_top.index(False))
                first = match[:, 0].tolist() + [False]
                stats.top1_len.append(first.index(False))
                if prefix is not None:
                    _count_conditional(stats, prefix, m, list(seq[: n + 1]), truth.tolist(), vocab, top_k)
                drafter.commit(sid, FeatureDelta(n, (seq[n],), r.features[n : n + 1]))
                bar.update()
        finally:
            drafter.close(sid)
    bar.close()
    return stats


def _count_conditional(stats: PositionStats, prefix, marginals, context: list[int], truth: list[int],
                       vocab: torch.Tensor, top_k: int) -> None:
    """Rank the draft vocabulary at each depth given the TRUE parent token (the head scores
    the marginal's top 256 only: a token outside them is never proposed, so it counts as a miss)."""
    from presto_sd.method.scores import ScoringContext

    ctx = ScoringContext(marginals, context)
    for d in range(1, len(truth) + 1):
        log_rho = prefix.log_rho(ctx, d, [truth[: d - 1]], vocab[None], None)[0]
        best = vocab[log_rho.topk(top_k).indices]
        stats.cond_hits[d - 1, 0] += int(best[0] == truth[d - 1])
        stats.cond_hits[d - 1, 1] += int(truth[d - 1] in best.tolist())


def replay_rows(logs: Sequence[RunLog]) -> list[dict[str, Any]]:
    """tau and mean tree size per (dataset, method, budget), then pooled ``all`` rows."""
    from presto_sd.app.bench.stats import table_rows

    keep = ("dataset", "method", "budget", "prompts", "rounds", "new_tokens", "tau", "mean_tree_size",
            "params")
    return [{k: row[k] for k in keep} for row in table_rows(logs, greedy=True)]


def save_recordings(path, recordings: dict[str, Recording]) -> None:
    torch.save({k: (r.prompt, r.continuation, r.features) for k, r in recordings.items()}, path)


def load_recordings(path) -> dict[str, Recording]:
    raw = torch.load(path, weights_only=False)
    return {k: Recording(tuple(p), tuple(c), f) for k, (p, c, f) in raw.items()}
