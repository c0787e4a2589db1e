"""The packed forward: many sessions' new tokens through ONE target forward.

Plain AR steps, tree nodes and prompt chunks of many sessions go through the target as one
packed sequence: the linear layers see exactly the real token rows, through row-invariant
kernels (``invariant.py``), and attention runs per session over that session's own KV slot
(``session_kv.py``). A prompt chunk attends by itself with transformers' own sdpa. Decode
rows (AR steps and tree nodes) attend one row each (``invariant.row_attention``): an AR step
reads the first keys of its slot, a tree node gathers its committed prefix and ancestors
into the same layout, so a node's row is bitwise the AR step that computes its token,
whatever else shares the call. What every layer does is worked out once per forward
(``_Plan``).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from presto_sd.models import native_rows
from presto_sd.models.invariant import invariant_rows, key_width, row_attention
from presto_sd.models.session_kv import KVPage, SessionKV

ATTENTION = "presto_sessions"  # the attention implementation name this module registers


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

    ``positions`` None: the rows are AR steps, each reading the first ``width`` keys of its
    slot (``slots [R]``). Else one session's tree nodes, ``positions [R, width]`` the key
    positions in its slot (the committed prefix, then the node's ancestors, then 0s,
    masked). ``visible [R, width]`` is True for each row's own keys (the rest masked):
    worked out once for every layer.
    """

    page: KVPage
    rows: torch.Tensor  # query indices in the packed sequence [R]
    width: int
    visible: torch.Tensor
    positions: torch.Tensor | None = None
    slot: int = 0  # a tree's: the session's slot
    slots: torch.Tensor | None = None  # AR steps': each row's slot
    native: _NativeUnits | None = None  # the "native" kernel's view of the rows, in place


@dataclass(frozen=True)
class _NativeUnits:
    """A row group as ``native_rows.unit_attention`` reads it from the page, without a copy:
    a unit a (row, KV head), each with its run of the page (``kv_offset``: the same at every
    layer), its row of key positions (``pos``: a tree's ``positions``, or ``0..width`` for AR
    steps) and how many of them it sees. A tree's rows share the committed prefix (``runs``:
    read once for them all, each row's arithmetic unchanged); AR steps, of different sessions,
    share nothing."""

    kv_offset: torch.Tensor  # [R * kv_heads]
    pos: torch.Tensor  # [R, width] or [1, width]
    pos_row: torch.Tensor  # [R * kv_heads]
    seen: torch.Tensor  # [R * kv_heads]
    runs: native_rows.SharedRuns | None = None

    @classmethod
    def of(cls, page: KVPage, row_slots: torch.Tensor, seen: torch.Tensor,
           positions: torch.Tensor | None, width: int, prefix: int = 0) -> _NativeUnits:
        """``prefix``: a tree's committed keys (positions ``0..prefix``, every row's first)."""
        kv_heads, head_dim = page.shape
        rows = len(row_slots)
        offset = (row_slots[:, None] * kv_heads + torch.arange(kv_heads)) * (page.capacity * head_dim)
        if positions is None:  # AR steps: each reads its slot's first keys
            pos, pos_row = torch.arange(width)[None], torch.zeros(rows * kv_heads, dtype=torch.long)
        else:
            pos, pos_row = positions, torch.arange(rows).repeat_interleave(kv_heads)
        # the C kernel reads where these point; checked here once a forward (``indices_checked``)
        if (int(pos.min()) < 0 or int(pos.max()) >= page.capacity or int(row_slots.min()) < 0
                or int(row_slots.max()) >= page.slots or int(seen.max()) > width):
            raise RuntimeError(f"packed plan: keys past the page ({page.capacity} keys, {page.slots} slots)")
        runs = None if positions is None else native_rows.SharedRuns.by_kv_head(rows, kv_heads, prefix)
        return cls(offset.flatten(), pos.contiguous(), pos_row, seen.repeat_interleave(kv_heads), runs)


@dataclass(frozen=True)
class _Writes:
    """The decode rows (AR steps, tree nodes) of one page: their new K/V entries, written in
    one call per layer, row ``rows[i]``'s at ``positions[i]`` of slot ``slots[i]``."""

    page: KVPage
    rows: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True)
class _Plan:
    """What a packed forward's attention does at every layer, worked out once."""

    chunks: tuple[Segment, ...]  # prompt chunks (the decode rows' entries are in ``writes``)
    writes: tuple[_Writes, ...]
    groups: tuple[_RowGroup, ...]
    attention: str = "eager"  # the decode rows' ``row_attention`` kernel


_PLAN: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("presto_plan", default=None)


def _plan(segments: Sequence[Segment], device: torch.device, attention: str) -> _Plan:
    # page -> its decode rows' new entries as (query row, slot, position): written in one call
    writes: dict[int, list[tuple[int, int, int]]] = {}
    # (page, width, gathered from slot or -1) -> rows as (query row, slot, length, new keys seen)
    by_key: dict[tuple[int, int, int], list[tuple[int, int, int, tuple[int, ...]]]] = {}
    pages: dict[int, KVPage] = {}
    chunks: list[Segment] = []  # prompt chunks: written and attended segment by segment
    for s in segments:
        if not s.decode_rows:
            chunks.append(s)
            continue
        page, length, slot = s.kv.page, s.kv.length, s.kv.slot
        pages[id(page)] = page
        writes.setdefault(id(page), []).extend((s.start + i, slot, length + i) for i in range(s.n))
        if s.ancestors is None:  # an AR step: its key is written at ``length``, its slot read from 0
            width = key_width(length + 1)
            gather = slot if width > page.capacity else -1
            by_key.setdefault((id(page), width, gather), []).append((s.start, slot, length, (0,)))
            continue
        for i, path in enumerate(s.ancestors):  # a tree node: its keys gathered
            by_key.setdefault((id(page), key_width(length + len(path)), slot), []).append(
                (s.start + i, slot, length, path))

    def tensor(values) -> torch.Tensor:
        return torch.tensor(values, device=device)

    groups = []
    for (page_id, width, gather), rows in by_key.items():
        page = pages[page_id]
        seen = torch.tensor([length + len(new) for _, _, length, new in rows])
        queries = tensor([r[0] for r in rows])
        visible = (torch.arange(width)[None] < seen[:, None]).to(device)
        positions = None
        if gather >= 0:  # the committed prefix, then the row's new keys, then 0s (masked)
            positions = torch.arange(width).repeat(len(rows), 1)
            for r, (_, _, length, new) in enumerate(rows):
                positions[r, length : length + len(new)] = length + torch.tensor(new)
                positions[r, length + len(new) :] = 0
        row_slots = torch.tensor([r[1] for r in rows])
        native = None
        if attention == "native":  # a tree's rows (one session) share its committed prefix
            native = _NativeUnits.of(page, row_slots, seen, positions, width, min(r[2] for r in rows))
        if positions is not None:
            groups.append(_RowGroup(page, queries, width, visible, positions.to(device), slot=gather,
                                    native=native))
        else:
            groups.append(_RowGroup(page, queries, width, visible, slots=row_slots.to(device), native=native))
    plan_writes = tuple(_Writes(pages[page_id], *(tensor(list(column)) for column in zip(*entries)))
                        for page_id, entries in writes.items())
    return _Plan(tuple(chunks), plan_writes, tuple(groups), attention)


def packed_plan(segments: Sequence[Segment], device: torch.device, attention: str = "eager") -> _Plan:
    """Reserve every segment's KV room and work out what attention does at every layer
    (``attention``: the decode rows' kernel, one ``pick_attention_kernel`` found row-invariant)."""
    for s in segments:
        s.kv.reserve(s.kv.length + s.n)
    return _plan(segments, device, attention)


@contextlib.contextmanager
def packed_forward(model: PreTrainedModel, segments: Sequence[Segment], attention: str = "eager",
                   ) -> Iterator[None]:
    """Inside: the transformers model's forward over the packed tokens attends per segment,
    and its linear layers run row-invariant (``invariant.py``; ``install_invariant_linears``).
    (The owned decoder, ``llama.py``, takes the plan as an argument instead.)"""
    configs = _attention_configs(model)
    saved = [c._attn_implementation for c in configs]
    token = _PLAN.set(packed_plan(segments, model.device, attention))
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
    return session_attention(plan, module, query, key, value, **kwargs), None


def session_attention(plan: _Plan, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, **kwargs) -> torch.Tensor:
    """``_session_attention`` with its plan given: [1, heads, N, head_dim] -> [1, N, heads, head_dim]."""
    layer = module.layer_idx
    out = query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3])
    for w in plan.writes:  # the decode rows' entries: one write per page
        w.page.keys[layer][w.slots, :, w.positions] = key[0, :, w.rows].transpose(0, 1)
        w.page.values[layer][w.slots, :, w.positions] = value[0, :, w.rows].transpose(0, 1)
    for s in plan.chunks:  # a prompt chunk attends by itself, causal
        new = slice(s.start, s.start + s.n)
        k, v = s.kv.write(layer, key[:, :, new], value[:, :, new])
        mask = None
        if s.kv.length > 0:  # a chunk after a prefix: causal, aligned right
            mask = _causal_mask(s.kv.length, s.n, query.dtype, query.device)
        out[:, new], _ = sdpa_attention_forward(module, query[:, :, new], k, v, mask, **kwargs)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    for g in plan.groups:
        _group_attention(layer, g, query, out, scaling, plan.attention)
    return out


def _group_attention(layer: int, g: _RowGroup, query: torch.Tensor, out: torch.Tensor,
                     scaling: float, kernel: str) -> None:
    """One row group's attention, into its rows of ``out``."""
    page = g.page
    kv_heads, head_dim = page.shape
    n, width = len(g.rows), g.visible.shape[-1]  # the width as a tensor's size: symbolic when compiled
    q = query[0, :, g.rows].transpose(0, 1).reshape(n, kv_heads, -1, head_dim)  # [R, kv, group, hd]
    if g.native is not None and not torch.compiler.is_compiling():  # in place: nothing gathered
        u = g.native
        units = q.reshape(n * kv_heads, -1, head_dim).contiguous()
        attn = native_rows.unit_attention(units, page.keys[layer], page.values[layer], u.kv_offset, u.pos,
                                          u.pos_row, u.seen, scaling, u.runs, indices_checked=True)
        out[0, g.rows] = attn.view(n, -1, head_dim)
        return
    if g.positions is not None:  # one session's keys gathered: [kv_heads, R, width, head_dim]
        index = g.positions.flatten()
        k = page.keys[layer][g.slot].index_select(1, index).view(kv_heads, n, width, head_dim)
        v = page.values[layer][g.slot].index_select(1, index).view(kv_heads, n, width, head_dim)
        attn = row_attention(q.transpose(0, 1), k, v, g.visible[None], scaling, kernel).transpose(0, 1)
    else:  # AR steps: only their own slots' first keys, copied out contiguous (a strided
        # view of a page's slot range would be copied by the matmul anyway, transposed)
        k = page.keys[layer][:, :, :width].index_select(0, g.slots)
        v = page.values[layer][:, :, :width].index_select(0, g.slots)
        attn = row_attention(q, k, v, g.visible[:, None], scaling, kernel)
    out[0, g.rows] = attn.reshape(n, -1, head_dim)


AttentionInterface.register(ATTENTION, _session_attention)
