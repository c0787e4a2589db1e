"""Sample-and-match verification: lossless for any tree the drafter proposes.

Walk from the root; at node ``u`` draw ``x ~ p_T(. | path(u))`` exactly as plain sampling
would (greedy: argmax); if a child of ``u`` carries ``x`` move to it, else stop. The
output (accepted path + the last ``x`` as the bonus token) is distributed exactly as the
target's own samples, whatever the tree, because the tree is fixed before ``x`` is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from presto_sd.method.tree import TokenTree

# Temperatures below this are greedy (stored as 0), as in vLLM: the limit of T -> 0 is the
# argmax, and logits / T would overflow to inf (then NaN probabilities) long before T = 0.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"sampling.temperature = {self.temperature}: must be finite and >= 0")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise ValueError(f"sampling.top_p = {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k = {self.top_k}: must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution after temperature, top-k and top-p, shape as ``logits``.

    Greedy returns the plain softmax: it is what traces record as ``p_T`` of a token.
    """
    scores = logits.float()
    if params.greedy:
        return torch.softmax(scores, dim=-1)
    scores = scores / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p; the first token always stays,
        # even for a top_p that rounds to 0 in float32 (1e-300: greedy in the limit)
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """One token from a logits row [V], as plain AR decoding draws it."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = sampling_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class WalkResult:
    path: list[int]  # accepted node indices, root first
    bonus: int  # the target's own token after the last accepted node

    @property
    def accepted_len(self) -> int:
        """Accepted draft tokens (root excluded)."""
        return len(self.path) - 1


def walk_tree(
    tree: TokenTree,
    logits: torch.Tensor | Callable[[int], torch.Tensor],
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> WalkResult:
    """Sample-and-match over the target logits of the tree's nodes.

    ``logits`` is [N, V], or a function node -> [V] so that a verifier computes the
    lm_head only for the nodes the walk visits (most are never reached).
    """
    logits_at = logits if callable(logits) else logits.__getitem__
    node = 0
    path = [0]
    while True:
        x = sample_token(logits_at(node), params, generator)
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == x), None)
        if nxt is None:
            return WalkResult(path=path, bonus=x)
        node = nxt
        path.append(node)


def node_token_probs(
    tree: TokenTree, logits: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """``p_T(token(u) | path(parent(u)))`` for every node [N]; the root gets 1.

    These are the per-node traces rho predictors are trained on.
    """
    probs = sampling_probs(logits, params)
    parents = torch.tensor(tree.parents[1:], dtype=torch.long)
    tokens = torch.tensor(tree.tokens[1:], dtype=torch.long)
    out = torch.ones(len(tree.tokens))
    if len(parents):
        out[1:] = probs[parents, tokens]
    return out
