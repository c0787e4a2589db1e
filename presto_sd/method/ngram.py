"""A small n-gram LM with interpolated (Dirichlet) backoff, for the n-gram rho provider.

``p_k(t | h) = (c(h, t) + beta * p_{k-1}(t | h[1:])) / (c(h) + beta)``, down to a unigram
that is itself smoothed toward uniform, so every token keeps a non-zero probability.
Counts are plain dicts: built once from target-generated text (a table shipped with the
drafter) and updated online from each request's own context.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

import torch


class NGramModel:
    def __init__(self, order: int = 3, vocab_size: int = 50_000, beta: float = 2.0) -> None:
        if order < 1:
            raise ValueError(f"ngram.order = {order}: must be >= 1")
        self.order = order
        self.vocab_size = vocab_size
        self.beta = beta
        # counts[k][history tuple of length k] -> {token: count}; totals alongside
        self.counts: list[dict[tuple[int, ...], dict[int, int]]] = [
            defaultdict(dict) for _ in range(order)
        ]
        self.totals: list[dict[tuple[int, ...], int]] = [defaultdict(int) for _ in range(order)]

    def update(self, tokens: list[int], history: list[int] | None = None) -> None:
        """Count ``tokens``, each conditioned on what precedes it (``history`` then tokens)."""
        seq = list(history or [])[-(self.order - 1) :] if self.order > 1 else []
        start = len(seq)
        seq.extend(tokens)
        for i in range(start, len(seq)):
            t = seq[i]
            for k in range(self.order):
                if i - k < 0:
                    break
                h = tuple(seq[i - k : i])
                row = self.counts[k][h]
                row[t] = row.get(t, 0) + 1
                self.totals[k][h] += 1

    def probs(self, history: list[int], candidates: list[int]) -> torch.Tensor:
        """``p(t | history)`` for each candidate token, shape [len(candidates)]."""
        uni_row = self.counts[0].get((), {})
        uni_total = self.totals[0].get((), 0)
        uniform = 1.0 / self.vocab_size
        p = [(uni_row.get(t, 0) + uniform) / (uni_total + 1.0) for t in candidates]
        for k in range(1, self.order):
            if len(history) < k:
                break
            h = tuple(history[-k:])
            total = self.totals[k].get(h, 0)
            if total == 0:
                break  # a longer history that was never seen has no more to say
            row = self.counts[k][h]
            p = [(row.get(t, 0) + self.beta * pt) / (total + self.beta) for t, pt in zip(candidates, p)]
        return torch.tensor(p, dtype=torch.float32)

    # -- persistence (a table shipped with a drafter) -----------------------------------
    def save(self, path: str | Path, min_count: int = 1) -> None:
        rows = []
        for k in range(self.order):
            for h, row in self.counts[k].items():
                kept = {t: c for t, c in row.items() if c >= min_count}
                if kept:
                    rows.append([k, list(h), list(kept.items())])
        meta = {"order": self.order, "vocab_size": self.vocab_size, "beta": self.beta}
        with gzip.open(path, "wt") as f:
            json.dump({"meta": meta, "rows": rows}, f)

    @classmethod
    def load(cls, path: str | Path) -> NGramModel:
        with gzip.open(path, "rt") as f:
            data = json.load(f)
        model = cls(**data["meta"])
        for k, h, items in data["rows"]:
            row = model.counts[k][tuple(h)]
            for t, c in items:
                row[int(t)] = c
            model.totals[k][tuple(h)] = sum(c for _, c in items)
        return model
