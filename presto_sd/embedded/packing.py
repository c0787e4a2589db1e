"""Batched verification, model side: pick a layout, gather the caches, take the new KV out.

Several sessions' trees go through ONE target forward as a ``TreeBatch`` (the layout and
its mask are pure, in ``presto_sd.method.tree``). Neither layout wins everywhere (SmolLM2, CPU,
one thread, context ~200; docs/services.md "Batched verification"):

- ``padded`` (one row per session, left-padded caches) computes its padding rows: trees
  of 4/8/16/64 draft nodes run as 4 x 65 rows, 679 ms against 364 ms packed;
- ``packed`` (every session in one row, block-diagonal mask) runs each node's attention
  over every session's prefix, which grows with the square of the batch: 4 x 16 nodes
  took 436 ms packed, 395 ms padded; 8 x 16 nodes 660 ms against 469 ms.

So ``auto`` counts each layout's FLOPs (linear layers per token row, attention per
query-key pair, padding included) and takes the cheaper: in those three cases, the faster
one. A batch whose mask would pass ``MAX_MASK_ELEMENTS`` is split into several forwards
(in call order), so no batch allocates without bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from presto_sd.method.tree import TokenTree, TreeBatch

LAYOUTS = ("auto", "packed", "padded")
MAX_MASK_ELEMENTS = 1 << 25  # 128 MiB of fp32 mask per forward

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, kv_heads, n, head_dim]


@dataclass(frozen=True)
class ForwardCost:
    """FLOPs of a decoder forward: per token row (the linear layers), per attention pair."""

    per_token: float
    per_pair: float

    @classmethod
    def of(cls, model: PreTrainedModel) -> ForwardCost:
        config = model.config.get_text_config(decoder=True)
        decoder = model.get_decoder()
        weights = sum(p.numel() for p in decoder.parameters())
        weights -= decoder.get_input_embeddings().weight.numel()  # a lookup, not a matmul
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_pair = 4 * config.num_attention_heads * head_dim * config.num_hidden_layers  # QK^T and AV
        return cls(per_token=2.0 * weights, per_pair=float(per_pair))


def choose_layout(
    trees: list[TokenTree], bases: list[int], cost: ForwardCost, layout: str = "auto"
) -> TreeBatch:
    """The layout asked for, or under ``auto`` the one with fewer FLOPs."""
    if layout == "packed":
        return TreeBatch.packed(trees, bases)
    if layout == "padded":
        return TreeBatch.padded(trees, bases)
    candidates = (TreeBatch.padded(trees, bases), TreeBatch.packed(trees, bases))
    return min(candidates, key=lambda b: b.cost(cost.per_token, cost.per_pair))


def _mask_elements(batch: TreeBatch) -> int:
    return len(batch.rows) * batch.query_len * (batch.prefix_len + batch.query_len)


def plan_batches(
    trees: list[TokenTree], bases: list[int], cost: ForwardCost, layout: str = "auto",
    max_mask_elements: int = MAX_MASK_ELEMENTS,
) -> list[tuple[list[int], TreeBatch]]:
    """Consecutive groups of tree indices and their layouts, one forward each.

    One group unless its mask would pass ``max_mask_elements``; a single tree always fits.
    """
    groups: list[tuple[list[int], TreeBatch]] = []
    group: list[int] = []
    batch: TreeBatch | None = None
    for i in range(len(trees)):
        grown = choose_layout([trees[j] for j in [*group, i]], [bases[j] for j in [*group, i]], cost, layout)
        if group and _mask_elements(grown) > max_mask_elements:
            groups.append((group, batch))
            group = []
            grown = choose_layout([trees[i]], [bases[i]], cost, layout)
        group, batch = [*group, i], grown
    if group:
        groups.append((group, batch))
    return groups


def gather_cache(caches: list[DynamicCache], batch: TreeBatch) -> DynamicCache:
    """A temporary cache [rows, kv_heads, prefix_len, head_dim]: every session's prefix at
    its slot, zeros in the padding (masked; zeros, not garbage, so 0 * weight stays 0)."""
    layers = []
    for layer in range(len(caches[0].layers)):
        k0, v0 = caches[0].layers[layer].keys, caches[0].layers[layer].values
        rows, length = len(batch.rows), batch.prefix_len
        keys = k0.new_zeros(rows, k0.shape[1], length, k0.shape[3])
        values = v0.new_zeros(rows, v0.shape[1], length, v0.shape[3])
        for i, cache in enumerate(caches):
            r, start, _ = batch.slot(i)
            end = start + batch.bases[i]
            keys[r, :, start:end] = cache.layers[layer].keys[0]
            values[r, :, start:end] = cache.layers[layer].values[0]
        layers.append((keys, values))
    return DynamicCache(layers)


def node_kv(cache: DynamicCache, batch: TreeBatch, i: int, nodes: list[int]) -> KV:
    """Tree ``i``'s new KV entries at ``nodes`` (tree indices), out of the forward's cache."""
    r, _, q = batch.slot(i)
    index = torch.tensor(nodes, dtype=torch.long, device=cache.layers[0].keys.device)
    index += batch.prefix_len + q
    return [(layer.keys[r : r + 1].index_select(-2, index), layer.values[r : r + 1].index_select(-2, index))
            for layer in cache.layers]


def append_kv(cache: DynamicCache, kv: KV) -> None:
    for layer, (keys, values) in zip(cache.layers, kv):
        layer.keys = torch.cat([layer.keys, keys], dim=-2)
        layer.values = torch.cat([layer.values, values], dim=-2)


def keep_positions(cache: DynamicCache, keep: torch.Tensor) -> None:
    """Keep only the KV positions in ``keep`` (the prefix and the accepted path)."""
    contiguous = len(keep) == 0 or int(keep[-1]) == len(keep) - 1  # a plain truncation
    for layer in cache.layers:
        if contiguous:
            layer.keys, layer.values = layer.keys[..., : len(keep), :], layer.values[..., : len(keep), :]
        else:
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)
