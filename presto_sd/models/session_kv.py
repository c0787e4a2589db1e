"""Each session's KV in its own buffers, read in place by a batched forward.

Many sessions' new tokens (plain AR steps, tree nodes, prompt chunks) go through ONE
target forward as one packed sequence: the linear layers see exactly the real token rows
(no padding), and attention runs per session over that session's own buffers. A prompt
chunk attends by itself with transformers' own sdpa. Decode rows (AR steps and tree
nodes) attend one row each (``invariant.row_attention``): an AR step reads its keys in
place, a tree node gathers its committed prefix and ancestors into the same layout, so a
node's row is bitwise the AR step that computes its token, whatever else shares the call.

A forward writes its new KV after a session's committed ``length`` and leaves ``length``
alone: the caller commits (``keep``) what it accepts, so a refused or failed call never
changes a session.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from presto_sd.models.invariant import KEY_BLOCK, invariant_rows, key_width, row_attention

ATTENTION = "presto_sessions"  # the attention implementation name this module registers
_ROUND = KEY_BLOCK  # capacities are multiples of this: a row reads whole key blocks in place
_GROWTH = 1.5  # a full buffer grows to this many times what it needs: amortised O(1) appends


class KVPage:
    """Slots of per-layer key and value tensors [slots, kv_heads, capacity, head_dim].

    Each slot holds one session's KV. The slots of a shared page (``KVStore``) sit side by
    side in one tensor, so one attention call reads many sessions' AR steps in place. The
    slot count doubles up to ``max_slots`` as sessions arrive (copying only this page).
    """

    def __init__(self, layers: int, shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
                 capacity: int, max_slots: int = 1, shared: bool = False) -> None:
        self.layers, self.shape, self.dtype, self.device = layers, shape, dtype, device
        self.capacity, self.max_slots, self.shared = capacity, max_slots, shared
        self.keys = [self._zeros(1) for _ in range(layers)]
        self.values = [self._zeros(1) for _ in range(layers)]
        self._used: set[int] = set()
        # a finalizer may give a slot back from any thread, or from this one: a garbage
        # collection that runs inside ``take`` drops a session there (re-entrant, or it deadlocks)
        self._lock = threading.RLock()

    def _zeros(self, slots: int) -> torch.Tensor:
        # zeros, not empty: a masked position is never weighted, but 0 * NaN would still be NaN
        return torch.zeros(slots, self.shape[0], self.capacity, self.shape[1], dtype=self.dtype,
                           device=self.device)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    def take(self) -> int | None:
        """The lowest free slot (growing the page), or None when the page is full."""
        with self._lock:
            slot = next((i for i in range(self.max_slots) if i not in self._used), None)
            if slot is None:
                return None
            if slot >= self.slots:
                grown = min(self.max_slots, 2 * self.slots)
                for buffers in (self.keys, self.values):
                    for i, old in enumerate(buffers):
                        buffers[i] = torch.cat([old, self._zeros(grown - old.shape[0])])
            self._used.add(slot)
            return slot

    def give(self, slot: int) -> None:
        with self._lock:
            self._used.discard(slot)


class KVStore:
    """The shared pages of an engine's sessions, by capacity class (``min_capacity`` x 2^k).

    A session lives in one slot; outgrowing it moves it to a slot of the next class (a copy
    of its committed part, amortised O(1) per token). Slots come back when a session's
    ``SessionKV`` is dropped, however its session ends.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", page_slots: int = 16, min_capacity: int = 256) -> None:
        self.layers, self.shape, self.dtype = layers, (kv_heads, head_dim), dtype
        self.device = torch.device(device)
        self.page_slots, self.min_capacity = page_slots, min_capacity
        self.pages: dict[int, list[KVPage]] = {}

    @classmethod
    def for_model(cls, model: PreTrainedModel, **kwargs) -> KVStore:
        return cls(*_kv_shape(model), model.dtype, model.device, **kwargs)

    def session(self) -> SessionKV:
        return SessionKV(self.layers, *self.shape, self.dtype, self.device, store=self)

    def place(self, n: int) -> tuple[KVPage, int]:
        """A free slot that holds ``n`` entries."""
        capacity = self.min_capacity
        while capacity < n:
            capacity *= 2
        pages = self.pages.setdefault(capacity, [])
        for page in pages:
            if (slot := page.take()) is not None:
                return page, slot
        page = KVPage(self.layers, self.shape, self.dtype, self.device, capacity, self.page_slots,
                      shared=True)
        pages.append(page)
        return page, page.take()

    @property
    def nbytes(self) -> int:
        """Bytes the pages hold (every slot allocated, free or not)."""
        return sum(t.numel() * t.element_size() for pages in self.pages.values() for p in pages
                   for t in (*p.keys, *p.values))


class SessionKV:
    """One session's keys and values: a slot of a page, per layer [1, kv_heads, capacity, head_dim].

    ``length`` entries are committed. Without a store the session has a page of its own,
    that grows to 1.5x what it needs; in a store (the verifier's) it moves to the next
    capacity class. The session tables' KV budget counts committed positions: the growth
    room is up to as much again.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", store: KVStore | None = None) -> None:
        self._shape, self.dtype, self.device = (kv_heads, head_dim), dtype, torch.device(device)
        self._layers, self.store = layers, store
        self.page, self.slot = self._private(0), 0
        self._release: weakref.finalize | None = None
        self.length = 0

    @classmethod
    def for_model(cls, model: PreTrainedModel) -> SessionKV:
        return cls(*_kv_shape(model), model.dtype, model.device)

    def _private(self, capacity: int) -> KVPage:
        return KVPage(self._layers, self._shape, self.dtype, self.device, capacity)

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer a view [1, kv_heads, capacity, head_dim] of this session's slot."""
        return [t[self.slot : self.slot + 1] for t in self.page.keys]

    @property
    def values(self) -> list[torch.Tensor]:
        return [t[self.slot : self.slot + 1] for t in self.page.values]

    @property
    def capacity(self) -> int:
        return self.page.capacity

    @property
    def nbytes(self) -> int:
        """Bytes the slot holds (its capacity, not only the committed length)."""
        kv_heads, head_dim = self._shape
        return self.capacity * self.bytes_per_token(self._layers, kv_heads, head_dim, self.dtype)

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def reserve(self, n: int) -> None:
        """Room for ``n`` entries; moves to a larger slot (copying only the committed part)."""
        if n <= self.capacity:
            return
        if self.store is not None:
            page, slot = self.store.place(n)
        else:
            page, slot = self._private(-(-int(n * _GROWTH) // _ROUND) * _ROUND), 0
        for new, old in ((page.keys, self.page.keys), (page.values, self.page.values)):
            for t_new, t_old in zip(new, old):
                t_new[slot, :, : self.length] = t_old[self.slot, :, : self.length]
        if self._release is not None:
            self._release()  # the old slot is free again
        self.page, self.slot = page, slot
        self._release = weakref.finalize(self, page.give, slot) if page.shared else None

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New entries [1, kv_heads, T, head_dim] after the committed ones; the views
        [1, kv_heads, length + T, head_dim] that attention reads."""
        end = self.length + keys.shape[2]
        k, v = self.page.keys[layer], self.page.values[layer]
        k[self.slot, :, self.length : end] = keys[0]
        v[self.slot, :, self.length : end] = values[0]
        return k[self.slot : self.slot + 1, :, :end], v[self.slot : self.slot + 1, :, :end]

    def keep(self, new: Sequence[int]) -> None:
        """Commit the entries the last forward wrote at offsets ``new`` (increasing) after
        ``length``: moved in place to follow the committed ones."""
        if list(new) != list(range(len(new))):  # a tree path: move it down (a gather first)
            index = torch.tensor(new, dtype=torch.long, device=self.device) + self.length
            for t in (*self.page.keys, *self.page.values):
                row = t[self.slot]
                row[:, self.length : self.length + len(new)] = row.index_select(1, index)
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
        sl = slice(self.slot, self.slot + 1)
        return self.page.keys[layer][sl, :, : self.length], self.page.values[layer][sl, :, : self.length]


def _kv_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    c = model.config.get_text_config(decoder=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return c.num_hidden_layers, kv_heads, head_dim


@dataclass(frozen=True)
class Segment:
    """One session's share of a packed forward: ``n`` new tokens from query ``start``.

    ``ancestors`` None: causal new tokens (a prompt chunk; one token is an AR step). Else
    a tree: row ``i`` sees the committed prefix and the rows ``ancestors[i]`` (its path
    from the root, itself last), at position ``length + len(ancestors[i]) - 1``.
    """

    kv: SessionKV
    start: int
    n: int
    ancestors: tuple[tuple[int, ...], ...] | None = None

    @property
    def decode_rows(self) -> bool:
        """Rows attended one by one (``row_attention``): AR steps and tree nodes."""
        return self.n == 1 or self.ancestors is not None


@dataclass(frozen=True)
class _RowGroup:
    """Decode rows of one page and one key width, attended in one batched call.

    ``positions`` None: the rows are AR steps reading their slots' first ``width`` keys in
    place, over the slot range ``lo:hi`` (``at``: each row's slot - lo; slots in the range
    that are not the group's attend to key 0 and are dropped). Else one session's tree
    nodes, ``positions [R, width]`` the key positions in its slot (the committed prefix,
    then the node's ancestors, then 0s, masked). ``hidden`` masks each attending row's
    keys past its own (``[R or hi - lo, width]``): worked out once for every layer.
    """

    page: KVPage
    rows: torch.Tensor  # query indices in the packed sequence [R]
    width: int
    hidden: torch.Tensor
    positions: torch.Tensor | None = None
    slot: int = 0  # gathered: the session's slot
    lo: int = 0
    hi: int = 0
    at: torch.Tensor | None = None  # in place: None when the rows fill lo:hi in order


@dataclass(frozen=True)
class _Writes:
    """AR steps of one page: their new K/V entries, written in one call per layer."""

    page: KVPage
    rows: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor


@dataclass(frozen=True)
class _Plan:
    """What a packed forward's attention does at every layer, worked out once."""

    segments: tuple[Segment, ...]  # prompt chunks and trees (AR steps are in ``writes``)
    writes: tuple[_Writes, ...]
    groups: tuple[_RowGroup, ...]


_PLAN: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("presto_plan", default=None)


def _plan(segments: Sequence[Segment], device: torch.device) -> _Plan:
    steps: dict[int, list[Segment]] = {}
    # (page, width, gathered from slot or -1) -> rows as (query row, slot, length, new keys seen)
    by_key: dict[tuple[int, int, int], list[tuple[int, int, int, tuple[int, ...]]]] = {}
    pages: dict[int, KVPage] = {}
    for s in segments:
        if not s.decode_rows:
            continue
        page, length = s.kv.page, s.kv.length
        pages[id(page)] = page
        if s.ancestors is None:  # an AR step: its key is written at ``length``, read in place
            steps.setdefault(id(page), []).append(s)
            width = key_width(length + 1)
            gather = s.kv.slot if width > page.capacity else -1
            by_key.setdefault((id(page), width, gather), []).append((s.start, s.kv.slot, length, (0,)))
            continue
        for i, path in enumerate(s.ancestors):  # a tree node: its keys gathered
            by_key.setdefault((id(page), key_width(length + len(path)), s.kv.slot), []).append(
                (s.start + i, s.kv.slot, length, path))

    def tensor(values) -> torch.Tensor:
        return torch.tensor(values, device=device)

    groups = []
    for (page_id, width, gather), rows in by_key.items():
        seen = torch.tensor([length + len(new) for _, _, length, new in rows])
        queries = tensor([r[0] for r in rows])
        if gather >= 0:  # the committed prefix, then the row's new keys, then 0s (masked)
            positions = torch.arange(width).repeat(len(rows), 1)
            for r, (_, _, length, new) in enumerate(rows):
                positions[r, length : length + len(new)] = length + torch.tensor(new)
                positions[r, length + len(new) :] = 0
            hidden = torch.arange(width)[None] >= seen[:, None]
            groups.append(_RowGroup(pages[page_id], queries, width, hidden.to(device),
                                    positions.to(device), slot=gather))
            continue
        slots = [r[1] for r in rows]
        lo, hi = min(slots), max(slots) + 1
        seen_all = torch.ones(hi - lo, dtype=torch.long)  # a slot outside the group: key 0 only
        seen_all[torch.tensor(slots) - lo] = seen
        at = None if slots == list(range(lo, hi)) else tensor([x - lo for x in slots])
        hidden = torch.arange(width)[None] >= seen_all[:, None]
        groups.append(_RowGroup(pages[page_id], queries, width, hidden.to(device), lo=lo, hi=hi, at=at))
    writes = tuple(_Writes(group[0].kv.page, tensor([s.start for s in group]),
                           tensor([s.kv.slot for s in group]), tensor([s.kv.length for s in group]))
                   for group in steps.values())
    rest = tuple(s for s in segments if not (s.ancestors is None and s.n == 1))
    return _Plan(rest, writes, tuple(groups))


@contextlib.contextmanager
def packed_forward(model: PreTrainedModel, segments: Sequence[Segment]) -> Iterator[None]:
    """Inside: the model's forward over the packed tokens attends per segment, and its
    linear layers run row-invariant (``invariant.py``; ``install_invariant_linears``)."""
    for s in segments:
        s.kv.reserve(s.kv.length + s.n)
    configs = _attention_configs(model)
    saved = [c._attn_implementation for c in configs]
    token = _PLAN.set(_plan(segments, model.device))
    try:
        for c in configs:
            c._attn_implementation = ATTENTION
        with invariant_rows():
            yield
    finally:
        for c, impl in zip(configs, saved):
            c._attn_implementation = impl
        _PLAN.reset(token)


_CONFIGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its attention configs


def _attention_configs(model: PreTrainedModel) -> list:
    """The configs whose ``_attn_implementation`` a forward reads (walked once per model)."""
    if model not in _CONFIGS:
        seen: dict[int, object] = {}
        for m in model.modules():
            c = getattr(m, "config", None)
            if c is not None and hasattr(c, "_attn_implementation"):
                seen.setdefault(id(c), c)
        _CONFIGS[model] = list(seen.values())
    return _CONFIGS[model]


def _causal_mask(past: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    allowed = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _session_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """query/key/value [1, heads, N, head_dim] of the packed tokens -> [1, N, heads, head_dim].

    Every segment's new entries go into its slot first. A prompt chunk then attends by
    itself (transformers' sdpa, causal); decode rows (AR steps, tree nodes) attend one
    row each, in groups (``row_attention``), so a row's result is the same whatever
    shares the forward.
    """
    plan = _PLAN.get()
    if plan is None:
        raise RuntimeError(f"attention {ATTENTION!r} runs only inside packed_forward()")
    layer = module.layer_idx
    out = query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3])
    for w in plan.writes:  # AR steps: one write per page
        w.page.keys[layer][w.slots, :, w.lengths] = key[0, :, w.rows].transpose(0, 1)
        w.page.values[layer][w.slots, :, w.lengths] = value[0, :, w.rows].transpose(0, 1)
    for s in plan.segments:
        new = slice(s.start, s.start + s.n)
        k, v = s.kv.write(layer, key[:, :, new], value[:, :, new])
        if not s.decode_rows:
            mask = None
            if s.kv.length > 0:  # a chunk after a prefix: causal, aligned right
                mask = _causal_mask(s.kv.length, s.n, query.dtype, query.device)
            out[:, new], _ = sdpa_attention_forward(module, query[:, :, new], k, v, mask, **kwargs)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    for g in plan.groups:
        _group_attention(layer, g, query, out, scaling)
    return out, None


def _group_attention(layer: int, g: _RowGroup, query: torch.Tensor, out: torch.Tensor,
                     scaling: float) -> None:
    """One row group's attention, into its rows of ``out``."""
    page = g.page
    kv_heads, head_dim = page.shape
    n = len(g.rows)
    q = query[0, :, g.rows].transpose(0, 1).reshape(n, kv_heads, -1, head_dim)  # [R, kv, group, hd]
    if g.positions is not None:  # one session's keys gathered: [kv_heads, R, width, head_dim]
        index = g.positions.flatten()
        k = page.keys[layer][g.slot].index_select(1, index).view(kv_heads, n, g.width, head_dim)
        v = page.values[layer][g.slot].index_select(1, index).view(kv_heads, n, g.width, head_dim)
        attn = row_attention(q.transpose(0, 1), k, v, g.hidden[None], scaling).transpose(0, 1)
    else:  # in place over the slots' range
        if g.at is not None:
            q, qs = q.new_zeros(g.hi - g.lo, *q.shape[1:]), q
            q[g.at] = qs
        k = page.keys[layer][g.lo : g.hi, :, : g.width]
        v = page.values[layer][g.lo : g.hi, :, : g.width]
        attn = row_attention(q, k, v, g.hidden[:, None], scaling)
        if g.at is not None:
            attn = attn[g.at]
    out[0, g.rows] = attn.reshape(n, -1, head_dim)


AttentionInterface.register(ATTENTION, _session_attention)
