"""The decode rows' attention as a small C kernel, read in place from the KV page.

torch's fused SDPA costs a decode row ~40–100 µs a layer here, most of it not arithmetic:
the row's keys gathered into a contiguous copy, the call's setup, one OpenMP thread. A tree
of R rows pays that R times, over the whole context each time (docs/benchmarks.md,
2026-12-06 evening). ``csrc/row_attention.c`` reads each row's keys where they lie (the
positions ``packed._plan`` works out once a forward) and computes each (row, KV head) unit
alone, in one fixed order: a tree node's row is bitwise the AR step's by construction.

It is built on first use with the machine's C compiler (``$CC``, else ``cc``; ~0.5 s) into
the cache's ``kernels/`` (``$PRESTO_SD_CACHE``, ``~/.cache/presto-sd``; or ``$PRESTO_SD_KERNELS``),
keyed by the source, the compiler and the CPU, since ``-march=native`` code is this CPU's. No
compiler, a failed build, a read-only cache or ``PRESTO_SD_NATIVE_ROWS=0``: ``available()`` is
False and the verifier keeps torch's SDPA.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from presto_sd.models.cache import cache_dir

SOURCE = Path(__file__).with_name("csrc") / "row_attention.c"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
DISABLE_ENV = "PRESTO_SD_NATIVE_ROWS"
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # the C kernel's MAX_G / MAX_D: query heads per KV head, head_dim
_log = logging.getLogger(__name__)
_P, _I = ctypes.c_void_p, ctypes.c_int64
_FUNCTIONS = {torch.bfloat16: "row_attention_bf16", torch.float32: "row_attention_f32"}


def available() -> bool:
    """Is the kernel built and loaded here (and not switched off by ``PRESTO_SD_NATIVE_ROWS=0``)?"""
    return os.environ.get(DISABLE_ENV, "1") != "0" and _library() is not None


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        _log.info("native row attention: no C compiler (%s): torch's SDPA instead", e)
        return None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, *FLAGS, _cpu_key()])
                         .encode()).hexdigest()[:16]
    kernels = os.environ.get("PRESTO_SD_KERNELS")
    try:  # a read-only cache (a container's root) is a build that cannot happen, not an error
        cache = Path(kernels) if kernels else cache_dir("kernels")
    except OSError as e:
        _log.warning("native row attention: no kernel cache (%s): torch's SDPA instead", e)
        return None
    lib = cache / f"row_attention-{key}.so"
    if not lib.is_file():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            # built beside it, then renamed: another process never loads half a file
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                staged = Path(tmp) / lib.name
                subprocess.run([compiler, *FLAGS, "-o", str(staged), str(SOURCE)], check=True,
                               capture_output=True, text=True, timeout=120)
                staged.rename(lib)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or e
            _log.warning("native row attention: the build failed (%s): torch's SDPA instead", detail)
            return None
    try:
        dll = ctypes.CDLL(str(lib))
    except OSError as e:
        _log.warning("native row attention: %s does not load (%s): torch's SDPA instead", lib, e)
        return None
    for name in _FUNCTIONS.values():
        fn = getattr(dll, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [_P] * 11 + [_I] * 5 + [ctypes.c_float]
    return dll


@dataclass(frozen=True)
class SharedRuns:
    """Units the kernel attends together: ``order[start[r]:start[r + 1]]`` form run ``r``, which
    read one run of the page (one ``kv_offset``) and the same first ``shared[r]`` key positions
    (a tree's rows over one KV head: the committed prefix). Each shared key and value is loaded
    once for the run; each unit's arithmetic stays what it is alone, bit for bit."""

    order: torch.Tensor  # [units], a permutation of the units
    start: torch.Tensor  # [runs + 1]
    shared: torch.Tensor  # [runs]

    @classmethod
    def by_kv_head(cls, rows: int, kv_heads: int, shared: int) -> SharedRuns:
        """Rows x KV heads units laid out row-major (``packed._NativeUnits``), the rows of one
        session: one run a KV head, its first ``shared`` keys in common."""
        order = torch.arange(rows * kv_heads).view(rows, kv_heads).t().contiguous().flatten()
        return cls(order, torch.arange(0, rows * kv_heads + 1, rows), torch.full((kv_heads,), shared))


def unit_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_offset: torch.Tensor,
                   pos: torch.Tensor, pos_row: torch.Tensor, seen: torch.Tensor, scaling: float,
                   runs: SharedRuns | None = None, indices_checked: bool = False) -> torch.Tensor:
    """Each unit's attention: ``query [U, G, D]`` over ``seen[u]`` keys of ``keys``/``values``
    (any contiguous CPU tensors; unit ``u``'s keys are rows ``pos[pos_row[u], :seen[u]]`` of the
    ``[*, D]`` run that starts ``kv_offset[u]`` elements in). Returns ``[U, G, D]``, the query's dtype.
    ``runs``: units that share their first keys, read once for them (the same result).

    Nothing is bounds-checked in C: this checks shapes, dtypes, layout, that every index
    stays inside its tensor and that the runs share what they say before the call;
    ``indices_checked``: the caller checked them once for many calls (``packed._NativeUnits``,
    once a forward, not once a layer: the reductions cost ~30 µs a call).
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("native row attention is not built here (no C compiler, or its build failed)")
    fn_name = _FUNCTIONS.get(query.dtype)
    if fn_name is None or not (keys.dtype == values.dtype == query.dtype):
        raise ValueError(f"native row attention: bf16 or fp32 throughout, not {query.dtype}/{keys.dtype}")
    for t in (query, keys, values, kv_offset, pos, pos_row, seen):
        if not (t.is_contiguous() and t.device.type == "cpu"):
            raise ValueError("native row attention: contiguous CPU tensors only")
    if not all(t.dtype == torch.int64 for t in (kv_offset, pos, pos_row, seen)):
        raise ValueError("native row attention: int64 indices")
    units, group, head_dim = query.shape
    width = pos.shape[-1]
    if not (len(kv_offset) == len(pos_row) == len(seen) == units and pos.dim() == 2 and units > 0):
        raise ValueError("native row attention: one kv_offset, pos_row and seen a unit; pos [rows, width]")
    if not indices_checked and _outside(keys, values, kv_offset, pos, pos_row, seen, head_dim):
        raise ValueError("native row attention: an index points outside its tensor")
    if runs is not None and not indices_checked:
        _check_runs(runs, kv_offset, pos, pos_row, seen)
    order, start, shared = (None, None, None) if runs is None else (
        runs.order.data_ptr(), runs.start.data_ptr(), runs.shared.data_ptr())
    out = torch.empty_like(query)
    status = getattr(lib, fn_name)(
        query.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), kv_offset.data_ptr(),
        pos.data_ptr(), pos_row.data_ptr(), seen.data_ptr(), order, start, shared,
        0 if runs is None else len(runs.shared), units, group, head_dim, width, scaling)
    if status == 1:
        raise ValueError(f"native row attention: group {group} and head_dim {head_dim} must be <= "
                         f"{MAX_GROUP} and <= {MAX_HEAD_DIM}")
    if status:
        raise MemoryError(f"native row attention: no memory for {group} x {width} scores")
    return out


def _outside(keys: torch.Tensor, values: torch.Tensor, kv_offset: torch.Tensor, pos: torch.Tensor,
             pos_row: torch.Tensor, seen: torch.Tensor, head_dim: int) -> bool:
    """Would the kernel read past ``keys``/``values``, ``pos`` or a row's width?"""
    if min(int(kv_offset.min()), int(pos.min()), int(pos_row.min()), int(seen.min())) < 0:
        return True
    end = int(kv_offset.max()) + (int(pos.max()) + 1) * head_dim  # past the furthest key read
    return (end > min(keys.numel(), values.numel()) or int(pos_row.max()) >= pos.shape[0]
            or int(seen.max()) > pos.shape[-1])


def _check_runs(runs: SharedRuns, kv_offset: torch.Tensor, pos: torch.Tensor, pos_row: torch.Tensor,
                seen: torch.Tensor) -> None:
    """Raise unless every unit is in exactly one run and each run's units read one run of the
    page and hold the positions they say they share (the C side trusts all of it)."""
    order, start, shared = runs.order, runs.start, runs.shared
    for t in (order, start, shared):
        if not (t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu"):
            raise ValueError("native row attention: runs as contiguous int64 CPU tensors")
    units = len(kv_offset)
    if not torch.equal(order.sort().values, torch.arange(units)):
        raise ValueError("native row attention: a run's order must hold every unit once")
    if (len(start) != len(shared) + 1 or int(start[0]) != 0 or int(start[-1]) != units
            or bool((start.diff() < 1).any())):
        raise ValueError("native row attention: runs must split the order into non-empty pieces")
    for r in range(len(shared)):
        members, n = order[int(start[r]) : int(start[r + 1])], int(shared[r])
        rows = pos[pos_row[members], :n]
        if (n < 0 or n > int(seen[members].min()) or bool((kv_offset[members] != kv_offset[members[0]]).any())
                or not bool((rows == rows[:1]).all())):
            raise ValueError(f"native row attention: run {r}'s units do not share {n} keys of one run")
