"""The draft token tree and its tree-attention layout.

Node 0 is the root: the anchor, i.e. the last committed token, which the target has not
processed yet. A node at depth ``d`` carries a token for absolute position ``n + d``
(``n`` = the number of tokens already in the target KV cache). ``parents[i] < i`` for
every non-root node, so the node list is a topological order and a tree is prefix-closed
by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class TreeError(ValueError):
    """A malformed tree. The message names the offending field and node."""


class TreeLimitError(TreeError):
    """A tree over a verifier's node or depth limit (RESOURCE_EXHAUSTED on the wire)."""


@dataclass(frozen=True)
class TreeLimits:
    """What a verifier accepts: draft nodes (root excluded), depth, vocabulary."""

    max_nodes: int = 1024
    max_depth: int = 64
    vocab_size: int | None = None


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # parents[0] == -1
    depths: tuple[int, ...]
    _children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        children: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            if 0 <= p < i:
                children[p].append(i)
        object.__setattr__(self, "_children", tuple(tuple(c) for c in children))

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_lists(cls, tokens: list[int], parents: list[int]) -> TokenTree:
        """Build a tree from tokens and parents, deriving depths (validated later)."""
        depths: list[int] = []
        for i, p in enumerate(parents):
            depths.append(0 if i == 0 or not 0 <= p < i else depths[p] + 1)
        return cls(tuple(int(t) for t in tokens), tuple(int(p) for p in parents), tuple(depths))

    @classmethod
    def root_only(cls, anchor: int) -> TokenTree:
        return cls((int(anchor),), (-1,), (0,))

    # -- queries ------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of draft nodes, root excluded (the budget a builder spends)."""
        return len(self.tokens) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def children(self, node: int) -> tuple[int, ...]:
        return self._children[node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Every node's ``path_to``: what a node attends to among the tree's nodes."""
        out: list[tuple[int, ...]] = []
        for i, p in enumerate(self.parents):
            out.append((*out[p], i) if p >= 0 else (i,))  # parents come first
        return tuple(out)

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path_to(node)]

    # -- validation ---------------------------------------------------------------------
    def validate(self, limits: TreeLimits = TreeLimits()) -> None:
        """Raise TreeError naming the first problem found."""
        n = len(self.tokens)
        if n == 0:
            raise TreeError("tree.tokens: empty tree (the root/anchor node is required)")
        if len(self.parents) != n or len(self.depths) != n:
            raise TreeError(
                f"tree: tokens/parents/depths lengths differ ({n}/{len(self.parents)}/"
                f"{len(self.depths)})"
            )
        if self.parents[0] != -1 or self.depths[0] != 0:
            raise TreeError("tree.parents[0]: the root must have parent -1 and depth 0")
        if n - 1 > limits.max_nodes:
            raise TreeLimitError(f"tree.tokens: {n - 1} draft nodes exceed the limit {limits.max_nodes}")
        for i in range(1, n):
            p = self.parents[i]
            if not 0 <= p < i:
                raise TreeError(
                    f"tree.parents[{i}] = {p}: a parent must come before its child (0 <= p < {i})"
                )
            if self.depths[i] != self.depths[p] + 1:
                raise TreeError(
                    f"tree.depths[{i}] = {self.depths[i]}: must be parent depth + 1 "
                    f"= {self.depths[p] + 1}"
                )
        if self.max_depth > limits.max_depth:
            raise TreeLimitError(f"tree.depths: depth {self.max_depth} exceeds the limit {limits.max_depth}")
        for i, t in enumerate(self.tokens):
            if t < 0 or (limits.vocab_size is not None and t >= limits.vocab_size):
                raise TreeError(
                    f"tree.tokens[{i}] = {t}: token out of range [0, {limits.vocab_size})"
                )

    # -- tree attention -----------------------------------------------------------------
    def ancestor_mask(self) -> torch.Tensor:
        """Bool [N, N]: ``mask[i, j]`` is True iff node j is node i or one of its ancestors."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, i] = True
            p = self.parents[i]
            if p >= 0:
                mask[i] |= mask[p]  # parents come first, so their row is complete
        return mask

    def position_ids(self, base: int) -> torch.Tensor:
        """Absolute positions ``base + depth`` of every node, shape [N]."""
        return torch.tensor(self.depths, dtype=torch.long) + base


def tree_attention_mask(
    tree: TokenTree, prefix_len: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive 4-D mask [1, 1, N, prefix_len + N]: the committed prefix plus own ancestors."""
    allowed = torch.cat(
        [torch.ones(len(tree.tokens), prefix_len, dtype=torch.bool), tree.ancestor_mask()], dim=1
    )
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
