"""Each session's KV in its own buffers, read in place by a batched forward.

Many sessions' new tokens (plain AR steps, tree nodes, prompt chunks) go through ONE
target forward as one packed sequence: the linear layers see exactly the real token rows
(no padding), and attention runs per session over a view of that session's own buffers
(no gather of anyone's cache into a batch, no copy of the past). transformers' own
``sdpa_attention_forward`` does each session's attention, so a lone session computes what
an ordinary cached forward computes.

A forward writes its new KV after a session's committed ``length`` and leaves ``length``
alone: the caller commits (``keep``) what it accepts, so a refused or failed call never
changes a session.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION = "presto_sessions"  # the attention implementation name this module registers
_ROUND = 16  # capacities are multiples of this
_GROWTH = 1.5  # a full buffer grows to this many times what it needs: amortised O(1) appends


class SessionKV:
    """One session's keys and values, per layer [1, kv_heads, capacity, head_dim].

    ``length`` entries are committed; a full buffer grows to 1.5x what it needs, so
    appending is amortised O(1) per token and nothing is copied per step. The session
    tables' KV budget counts committed positions: the growth room is up to half again.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self._shape, self.dtype, self.device = (kv_heads, head_dim), dtype, torch.device(device)
        self.keys: list[torch.Tensor] = [self._empty(0) for _ in range(layers)]
        self.values: list[torch.Tensor] = [self._empty(0) for _ in range(layers)]
        self.length = 0

    @classmethod
    def for_model(cls, model: PreTrainedModel) -> SessionKV:
        c = model.config.get_text_config(decoder=True)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return cls(c.num_hidden_layers, kv_heads, head_dim, model.dtype, model.device)

    def _empty(self, capacity: int) -> torch.Tensor:
        kv_heads, head_dim = self._shape
        return torch.zeros(1, kv_heads, capacity, head_dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold (allocated capacity, not only the committed length)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def reserve(self, n: int) -> None:
        """Room for ``n`` entries; grows the buffers (copying only the committed part)."""
        if n <= self.capacity:
            return
        capacity = -(-int(n * _GROWTH) // _ROUND) * _ROUND
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = self._empty(capacity)
                new[:, :, : self.length] = old[:, :, : self.length]
                buffers[i] = new

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New entries [1, kv_heads, T, head_dim] after the committed ones; the views
        [1, kv_heads, length + T, head_dim] that attention reads."""
        end = self.length + keys.shape[2]
        self.keys[layer][:, :, self.length : end] = keys
        self.values[layer][:, :, self.length : end] = values
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def keep(self, new: Sequence[int]) -> None:
        """Commit the entries the last forward wrote at offsets ``new`` (increasing) after
        ``length``: moved in place to follow the committed ones."""
        if list(new) != list(range(len(new))):  # a tree path: move it down (a gather first)
            index = torch.tensor(new, dtype=torch.long, device=self.device) + self.length
            for buffers in (self.keys, self.values):
                for t in buffers:
                    t[:, :, self.length : self.length + len(new)] = t.index_select(2, index)
        self.length += len(new)

    def append(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Commit new entries: per layer keys and values [1, kv_heads, T, head_dim]."""
        n = kv[0][0].shape[2]
        self.reserve(self.length + n)
        for layer, (keys, values) in enumerate(kv):
            self.write(layer, keys, values)
        self.length += n

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)

    def committed(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of a layer's committed keys and values [1, kv_heads, length, head_dim]."""
        return self.keys[layer][:, :, : self.length], self.values[layer][:, :, : self.length]


@dataclass(frozen=True)
class Segment:
    """One session's share of a packed forward: ``n`` new tokens from query ``start``.

    ``mask``: None for causal new tokens (a prompt chunk, one AR token), else an additive
    [1, 1, n, length + n] mask (a tree: the committed prefix plus its own ancestors).
    """

    kv: SessionKV
    start: int
    n: int
    mask: torch.Tensor | None = None


_SEGMENTS: contextvars.ContextVar[tuple[Segment, ...] | None] = contextvars.ContextVar(
    "presto_segments", default=None
)


@contextlib.contextmanager
def packed_forward(model: PreTrainedModel, segments: Sequence[Segment]) -> Iterator[None]:
    """Inside: the model's forward over the packed tokens attends per segment."""
    for s in segments:
        s.kv.reserve(s.kv.length + s.n)
    configs = _attention_configs(model)
    saved = [c._attn_implementation for c in configs]
    token = _SEGMENTS.set(tuple(segments))
    try:
        for c in configs:
            c._attn_implementation = ATTENTION
        yield
    finally:
        for c, impl in zip(configs, saved):
            c._attn_implementation = impl
        _SEGMENTS.reset(token)


def _attention_configs(model: PreTrainedModel) -> list:
    seen: dict[int, object] = {}
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "_attn_implementation"):
            seen.setdefault(id(c), c)
    return list(seen.values())


def _causal_mask(past: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    allowed = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _session_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """query/key/value [1, heads, N, head_dim] of the packed tokens -> [1, N, heads, head_dim]."""
    segments = _SEGMENTS.get()
    if segments is None:
        raise RuntimeError(f"attention {ATTENTION!r} runs only inside packed_forward()")
    layer = module.layer_idx
    outs = []
    for s in segments:
        q = query[:, :, s.start : s.start + s.n]
        k, v = s.kv.write(layer, key[:, :, s.start : s.start + s.n], value[:, :, s.start : s.start + s.n])
        mask = s.mask
        if mask is None and s.n > 1 and s.kv.length > 0:  # a chunk after a prefix: causal, aligned right
            mask = _causal_mask(s.kv.length, s.n, query.dtype, query.device)
        out, _ = sdpa_attention_forward(module, q, k, v, mask, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], None


AttentionInterface.register(ATTENTION, _session_attention)
