"""Each session's KV in its own buffers, read in place by a batched forward.

Sessions live as slots of shared pages (``KVStore``), so one attention call reads many
sessions' AR steps in place; ``packed.py`` runs the forward that reads and writes them.
A forward writes its new KV after a session's committed ``length`` and leaves ``length``
alone: the caller commits (``keep``) what it accepts, so a refused or failed call never
changes a session.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from presto_sd.models.invariant import KEY_BLOCK

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

    def give(self, slot: int) -> bool:
        """Free ``slot``; whether the page is now empty."""
        with self._lock:
            self._used.discard(slot)
            return not self._used

    @property
    def slot_nbytes(self) -> int:
        return 2 * self.layers * self.shape[0] * self.capacity * self.shape[1] * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_nbytes

    def growth_plan(self, wanted: int) -> tuple[int, int]:
        """``(taken, slots allocated)`` if ``wanted`` more sessions took slots here, as ``take`` would."""
        used, slots = len(self._used), self.slots
        taken = min(wanted, self.max_slots - used)
        need = used + taken
        grown = slots
        while grown < need:
            grown = min(self.max_slots, 2 * grown)
        return taken, grown - slots


class KVStore:
    """The shared pages of an engine's sessions, by capacity class (``min_capacity`` x 2^k).

    A session lives in one slot; outgrowing it moves it to a slot of the next class (a copy
    of its committed part, amortised O(1) per token). Slots come back when a session's
    ``SessionKV`` is dropped, however its session ends, and a page whose last slot comes
    back is freed. ``nbytes`` is what the pages hold; ``placement_bytes`` what placing
    more sessions would add to it: the verifier's KV budget admits by these two.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", page_slots: int = 16, min_capacity: int = 256) -> None:
        self.layers, self.shape, self.dtype = layers, (kv_heads, head_dim), dtype
        self.device = torch.device(device)
        self.page_slots, self.min_capacity = page_slots, min_capacity
        self.pages: dict[int, list[KVPage]] = {}
        self._lock = threading.RLock()  # finalizers give slots back from any thread, even inside place

    @classmethod
    def for_model(cls, model: PreTrainedModel, **kwargs) -> KVStore:
        return cls(*_kv_shape(model), model.dtype, model.device, **kwargs)

    def session(self) -> SessionKV:
        return SessionKV(self.layers, *self.shape, self.dtype, self.device, store=self)

    def capacity_for(self, n: int) -> int:
        capacity = self.min_capacity
        while capacity < n:
            capacity *= 2
        return capacity

    def place(self, n: int) -> tuple[KVPage, int]:
        """A free slot that holds ``n`` entries."""
        with self._lock:
            capacity = self.capacity_for(n)
            pages = self.pages.setdefault(capacity, [])
            for page in list(pages):  # a collection inside take may free (and drop) a page
                if (slot := page.take()) is not None:
                    if page not in pages:  # dropped empty by that collection: held again
                        self.pages.setdefault(capacity, []).append(page)
                    return page, slot
            page = KVPage(self.layers, self.shape, self.dtype, self.device, capacity, self.page_slots,
                          shared=True)
            self.pages.setdefault(capacity, []).append(page)
            return page, page.take()

    def give(self, page: KVPage, slot: int) -> None:
        """A session's slot back; an empty page is freed (its memory goes back at once)."""
        with self._lock:
            if page.give(slot):
                pages = self.pages.get(page.capacity, [])
                if page in pages:
                    pages.remove(page)
                if not pages:
                    self.pages.pop(page.capacity, None)

    def placement_bytes(self, sizes: Sequence[int]) -> int:
        """Bytes that placing one new slot for each of ``sizes`` entries would allocate.

        Exact for ``place`` as it runs: free slots first, pages grown by doubling in page
        order, new pages last. Order-independent within a class, so a batch's calls can be
        admitted one by one against the bytes of all before them.
        """
        wanted: dict[int, int] = {}
        for n in sizes:
            c = self.capacity_for(n)
            wanted[c] = wanted.get(c, 0) + 1
        total = 0
        with self._lock:
            for capacity, k in wanted.items():
                for page in self.pages.get(capacity, []):
                    taken, grown = page.growth_plan(k)
                    total += grown * page.slot_nbytes
                    k -= taken
                slot_nbytes = 2 * self.layers * self.shape[0] * capacity * self.shape[1] * self.dtype.itemsize
                while k > 0:  # new pages: 1, 2, 4 ... page_slots slots
                    take = min(k, self.page_slots)
                    slots = 1
                    while slots < take:
                        slots = min(self.page_slots, 2 * slots)
                    total += slots * slot_nbytes
                    k -= take
        return total

    @property
    def nbytes(self) -> int:
        """Bytes the pages hold (every slot allocated, free or not)."""
        with self._lock:
            return sum(p.nbytes for pages in self.pages.values() for p in pages)


class SessionKV:
    """One session's keys and values: a slot of a page, per layer [1, kv_heads, capacity, head_dim].

    ``length`` entries are committed. Without a store the session has a page of its own,
    that grows to 1.5x what it needs; in a store (the verifier's) it moves to the next
    capacity class. The engines' KV budgets count the bytes the slots hold (``nbytes``),
    growth room included, and admit a call by what it would allocate (``growth_bytes``).
    While a session moves, its old slot and its new one are both held: that copy is the
    only moment the bytes held pass what was admitted, by one slot.
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

    def growth_bytes(self, n: int) -> int:
        """Bytes ``reserve(n)`` would allocate (0 when ``n`` fits)."""
        if n <= self.capacity:
            return 0
        if self.store is not None:
            return self.store.placement_bytes([n])
        kv_heads, head_dim = self._shape
        return self.private_capacity(n) * self.bytes_per_token(self._layers, kv_heads, head_dim, self.dtype)

    @staticmethod
    def private_capacity(n: int) -> int:
        """The capacity a page of its own takes to hold ``n`` entries: room to grow, whole key blocks."""
        return -(-int(n * _GROWTH) // _ROUND) * _ROUND

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
            page, slot = self._private(self.private_capacity(n)), 0
        for new, old in ((page.keys, self.page.keys), (page.values, self.page.values)):
            for t_new, t_old in zip(new, old):
                t_new[slot, :, : self.length] = t_old[self.slot, :, : self.length]
        if self._release is not None:
            self._release()  # the old slot is free again
        self.page, self.slot = page, slot
        self._release = weakref.finalize(self, self.store.give, page, slot) if page.shared else None

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
