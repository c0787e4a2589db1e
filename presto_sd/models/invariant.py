"""Row-invariant kernels: a token row's result does not depend on the rows beside it.

Greedy speculative output is bitwise AR's only if a tree node's row, computed inside an
N-row verify forward, equals the AR step that computes the same token alone. Library
kernels do not promise that: on a CPU, MKL's fp32 GEMM rounds a row differently for 1,
2-3 and 4+ rows, and bf16's 1536->576 projection differs between 1 row and 2+. So the
verifier's forward runs every op that mixes rows through a kernel whose per-row result
is fixed by the row alone (``tests/test_invariance.py`` holds each one, on the target's
shapes):

- ``invariant_linear``: a lone row padded to two, through the first kernel whose rows
  agree in every call of >= 2 rows at that shape, found by probing it (``rows_agree``):
  ATen's for bf16 here, oneDNN's for fp32. None found: the verifier says so
  (``VerifierInfo.row_invariant``) and bf16 is not the CPU default.
- ``row_attention``: each query row attends over its own keys, as one element of a
  batched call whose shapes depend only on that row: keys ``[W, head_dim]`` with
  ``W = key_width(L)`` (the row's ``L`` visible keys rounded up to ``KEY_BLOCK``), the
  rest masked. A tree node reads its keys gathered (committed prefix, then its own
  ancestors): the same values at the same offsets as the AR step at its position, which
  reads them contiguous in place. Its kernel, the first a probe finds row-invariant
  (``pick_attention_kernel``): in bf16 a small C kernel that reads each row's keys in place
  (``native_rows.py``, where a C compiler built it), then torch's fused SDPA on one intra-op
  thread (on two, a row's result depends on which thread the call's batch gives it; fp32
  and bf16 here), else the eager ops.

RMSNorm, RoPE, the residual adds and the MLP's elementwise ops are per-row already.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from presto_sd.models import native_rows

KEY_BLOCK = 64  # a row attends over a multiple of this many keys; KV capacities are multiples of it

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("presto_invariant_rows", default=False)


def _aten(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


# candidates, fastest first where both are invariant (bf16 here: ATen's is ~2x oneDNN's,
# whose weights are re-laid out every call); fp32: MKL's rows differ at M = 1, 2-3, 4+
LINEAR_KERNELS: dict[str, Callable[..., torch.Tensor]] = {"aten": _aten, "onednn": _onednn}
# call sizes whose rows must agree, up to the most rows a verifier forward may hold
# (``MAX_INVARIANT_ROWS``: the orchestrator's batches are bounded by it, and a VerifyBatch
# call past it is refused in its slot); the reference is a call of the largest
MAX_INVARIANT_ROWS = 1024
PROBE_ROWS = (2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 65, 128, 257, 512, MAX_INVARIANT_ROWS)


@torch.library.custom_op("presto_sd::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
    return LINEAR_KERNELS[kernel](x, weight, bias)


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
    # in a compiled graph (``compiled.py``) an opaque op: inductor calls this very kernel
    # instead of lowering the matmul its own way (its bias add apart, its own GEMM)
    if torch.compiler.is_compiling():
        return _linear_op(x, weight, bias, kernel)
    return LINEAR_KERNELS[kernel](x, weight, bias)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     kernel: str = "aten") -> torch.Tensor:
    """``kernel``'s linear with every row computed as in any call of >= 2 rows: a lone row
    is computed as one of two. (One row is a matrix-vector product on every backend,
    rounded its own way: bf16's 1536->576 projection here gives a lone row that differs
    in ~1 of 6 random rows, so "alone agrees" cannot be probed reliably; it is not tried.)"""
    if x.dim() == 2 and x.shape[0] > 1:  # rows as they are (the owned decoder's)
        return _linear(x, weight, bias, kernel)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 1:
        rows = torch.cat([rows, rows])
    out = _linear(rows, weight, bias, kernel)
    return out[:m].reshape(*lead, out.shape[-1])


def rows_agree(kernel: str, in_features: int, out_features: int, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> bool:
    """Does every row of ``kernel``'s linear come out the same in every call size of
    ``PROBE_ROWS``, and alone? (Random data: a kernel that rounds by call size shows it.)"""
    cpu = torch.device(device).type == "cpu"
    if kernel == "onednn" and not (cpu and dtype in (torch.float32, torch.bfloat16)
                                   and torch.backends.mkldnn.is_available()):
        return False
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(device, dtype)
    x = torch.randn(max(PROBE_ROWS), in_features, generator=g).to(device, dtype)
    return rows_agree_in(lambda rows: invariant_linear(rows, w, kernel=kernel), x)


def rows_agree_in(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """Does every row of ``linear`` on the probe rows ``x`` (``max(PROBE_ROWS)`` of them) come
    out the same in every call size of ``PROBE_ROWS``, and alone?"""
    with torch.inference_mode():
        ref = linear(x)
        return (all(torch.equal(linear(x[:m]), ref[:m]) for m in PROBE_ROWS)
                and all(torch.equal(linear(x[i]), ref[i]) for i in range(8)))


@functools.cache
def pick_linear_kernel(in_features: int, out_features: int, dtype: torch.dtype,
                       device: str = "cpu") -> str | None:
    """The first of ``LINEAR_KERNELS`` whose rows agree at this shape, or None."""
    return next((k for k in LINEAR_KERNELS if rows_agree(k, in_features, out_features, dtype, device)), None)


def fusion_agrees(fused: Callable[[torch.Tensor], torch.Tensor],
                  parts: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> bool:
    """Is ``fused`` (one matmul over weights stacked by rows) bitwise ``parts`` side by side,
    on the probe rows ``x`` (``max(PROBE_ROWS)`` of them) at every call size of
    ``PROBE_ROWS`` and alone? With row-invariant parts, it is row-invariant too."""
    with torch.inference_mode():
        return all(torch.equal(fused(x[:m]), torch.cat([f(x[:m]) for f in parts], -1))
                   for m in (1, *PROBE_ROWS))


@functools.cache
def fusion_kernel_agrees(kernel: str, in_features: int, outs: tuple[int, ...], dtype: torch.dtype,
                         device: str = "cpu") -> bool:
    """``fusion_agrees`` for ``kernel``'s dense linear at these shapes (random data)."""
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(o, in_features, generator=g) / in_features**0.5).to(device, dtype) for o in outs]
    x = torch.randn(max(PROBE_ROWS), in_features, generator=g).to(device, dtype)
    fused = torch.cat(ws)
    return fusion_agrees(lambda r: invariant_linear(r, fused, kernel=kernel),
                         [lambda r, w=w: invariant_linear(r, w, kernel=kernel) for w in ws], x)


class InvariantLinear(torch.nn.Linear):
    """An ``nn.Linear`` that runs ``invariant_linear`` with its ``kernel`` inside
    ``invariant_rows()`` and is a plain ``nn.Linear`` outside (the model stays stock for
    anyone else, transformers' ``generate`` included)."""

    kernel: str = "aten"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _ACTIVE.get():
            return invariant_linear(x, self.weight, self.bias, self.kernel)
        return F.linear(x, self.weight, self.bias)


def install_invariant_linears(module: torch.nn.Module) -> bool:
    """Turn every ``nn.Linear`` under ``module`` into an ``InvariantLinear`` with the kernel
    ``pick_linear_kernel`` finds for its shape (in place: the weights stay where they
    are). True when every one has a row-invariant kernel here."""
    ok = True
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            kernel = pick_linear_kernel(m.in_features, m.out_features, m.weight.dtype, m.weight.device.type)
            m.__class__ = InvariantLinear
            m.kernel = kernel or "aten"
            ok &= kernel is not None
    return ok


@contextlib.contextmanager
def invariant_rows() -> Iterator[None]:
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def linear_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of a Llama-family decoder's linears and its lm_head, from its config."""
    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    h, i = c.hidden_size, c.intermediate_size
    return sorted({(h, heads * head_dim), (h, kv_heads * head_dim), (heads * head_dim, h),
                   (h, i), (i, h), (h, c.vocab_size)})


def attention_shape(config) -> tuple[int, int, int]:
    """(KV heads, query heads per KV head, head_dim) of a decoder, from its config."""
    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return kv_heads, c.num_attention_heads // kv_heads, head_dim


def native_bf16() -> bool:
    """Does this CPU do bf16 arithmetic natively (AVX512-BF16 or AMX)? Elsewhere bf16 is
    emulated, 3-5x slower than fp32 (measured on AVX2 machines: docs/benchmarks.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def invariant_kernels_for(config, dtype: torch.dtype, device: str = "cpu") -> bool:
    """Has every linear of a model of this config a row-invariant kernel here, in ``dtype``?"""
    return all(pick_linear_kernel(i, o, dtype, device) is not None for i, o in linear_shapes(config))


def key_width(length: int) -> int:
    """The key width a row with ``length`` visible keys attends over."""
    return -(-length // KEY_BLOCK) * KEY_BLOCK


def _eager_rows(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                scaling: float) -> torch.Tensor:
    # transformers' eager attention: scores in the model dtype, softmax in fp32
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scaling
    scores = torch.where(visible[..., None, :], scores, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values)


def _sdpa_rows(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
               scaling: float) -> torch.Tensor:
    # torch's fused CPU kernel (flash, fp32 accumulation): one call for the matmuls, the mask
    # and the softmax; ~2x the eager ops' speed at decode shapes (bf16, 2 cores). On ONE
    # intra-op thread: the kernel computes a (row, KV head) unit a little differently on
    # each OpenMP thread (its per-thread scratch), and which thread gets a unit depends on
    # how many units the call holds. Measured on a 2-vCPU EPYC: 1 % of fp32 outputs differ
    # between threads, ~1e-7 of bf16 ones after rounding (rare, but it broke a bf16 greedy
    # run at a near tie: docs/benchmarks.md); on one thread none, in 10 M.
    get_threads, set_threads = _openmp()
    # ATen sets a thread's OpenMP count at its first op (lazily): were this call that op, the
    # kernel would do it inside, after our set, and run on torch's count. Have it done first.
    torch.get_num_threads()
    threads = get_threads()
    set_threads(1)  # ~0.8 µs with the get and the restore (2-vCPU EPYC)
    try:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=visible[..., None, :],
                                              scale=scaling)
    finally:
        set_threads(threads)


@functools.cache
def _openmp() -> tuple[Callable[[], int], Callable[[int], None]]:
    """The OpenMP runtime's ``omp_get_max_threads`` / ``omp_set_num_threads``: the calling
    thread's count only. (``torch.set_num_threads`` also writes the process default every
    new thread starts from, which a server's ``own_compute`` keeps at 1.) The runtime torch
    loaded; without one, torch's own getter and setter."""
    try:
        lib = ctypes.CDLL(None)
        return lib.omp_get_max_threads, lib.omp_set_num_threads
    except (AttributeError, OSError):
        return torch.get_num_threads, torch.set_num_threads


def _native_rows(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    # ``native_rows``' C kernel over keys laid out as ``row_attention`` takes them (the probe's
    # and a compiled graph's way in); ``packed`` hands it the KV page itself, no copy. It reads
    # a row's first ``seen`` keys: ``visible`` must be a prefix mask (every caller's is).
    a, b, group, head_dim = query.shape
    width = keys.shape[-2]
    visible = visible.expand(a, b, width)
    seen = visible.sum(-1).flatten()
    if not torch.equal(visible, torch.arange(width, device=visible.device) < seen.view(a, b, 1)):
        raise ValueError("native row attention: each row must see a prefix of its keys")
    units = a * b
    runs, first_row = torch.arange(units) * (width * head_dim), torch.zeros(units, dtype=torch.long)
    return native_rows.unit_attention(
        query.reshape(units, group, head_dim).contiguous(), keys.contiguous(), values.contiguous(),
        runs, torch.arange(width)[None], first_row, seen, scaling).view(a, b, group, head_dim)


# candidates, fastest first: the first whose rows agree at the model's shapes is used
# ("native" where it is built, bf16 only: see ``pick_attention_kernel``)
ATTENTION_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "native": _native_rows, "sdpa": _sdpa_rows, "eager": _eager_rows}


def row_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  visible: torch.Tensor, scaling: float, kernel: str = "eager") -> torch.Tensor:
    """Per-row attention: query ``[A, B, group, head_dim]`` (a row's query heads grouped by
    the KV head they share; rows and KV heads as the two batch dims, either order), keys /
    values ``[A, B, W, head_dim]``; ``visible`` ``[A, B, W]`` (broadcast): True for the keys
    a row sees (SDPA's mask convention: worked out once a forward, not per layer). Returns
    ``[A, B, group, head_dim]``: one ``[group, W]`` attention per row and KV head, whatever
    the batch, through ``kernel`` (``ATTENTION_KERNELS``; "eager" and "native" hold by
    construction, "sdpa" where ``attention_rows_agree`` finds it does; the verifier probes
    every one it picks).

    The masked keys get weight exactly 0; they must hold finite values (0 * NaN is NaN).
    """
    if torch.compiler.is_compiling():
        # opaque in a compiled graph: inductor's softmax sums its own way, and SDPA's
        # one-thread scope is not traceable
        return _row_attention_op(query, keys, values, visible, scaling, kernel)
    return ATTENTION_KERNELS[kernel](query, keys, values, visible, scaling)


@torch.library.custom_op("presto_sd::row_attention", mutates_args=())
def _row_attention_op(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                      scaling: float, kernel: str) -> torch.Tensor:
    # contiguous: an op's output must have the strides its fake says (a tree's is transposed)
    return ATTENTION_KERNELS[kernel](query, keys, values, visible, scaling).contiguous()


@_row_attention_op.register_fake
def _(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
      scaling: float, kernel: str) -> torch.Tensor:
    return query.new_empty(*query.shape[:-1], values.shape[-1])


ATTENTION_PROBE_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 33)
ATTENTION_PROBE_WIDTHS = tuple(n * KEY_BLOCK for n in (1, 2, 5, 8, 9, 17))


def attention_rows_agree(kernel: str, kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
                         device: torch.device | str = "cpu") -> bool:
    """Does every row of ``kernel``'s ``row_attention`` come out the same in every call size
    of ``ATTENTION_PROBE_ROWS``, in both batch layouts (rows first: AR steps; KV heads first:
    a tree's nodes), whatever its masked keys hold, at each of ``ATTENTION_PROBE_WIDTHS``?
    (Random data, a row seeing a random number of its keys.) A reduced dtype is probed in
    fp32 too: its rounding hides most of a kernel's row variance (torch's SDPA on two
    threads: ~1 % of fp32 outputs differed, ~1e-7 of bf16 ones, which this probe missed)."""
    # (on a CPU, where fp32 and bf16 run the same kernel code)
    cpu = torch.device(device).type == "cpu"
    dtypes = (torch.float32, dtype) if cpu and dtype != torch.float32 else (dtype,)
    return all(_attention_rows_agree_in(kernel, kv_heads, group, head_dim, d, device) for d in dtypes)


def _attention_rows_agree_in(kernel: str, kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
                             device: torch.device | str) -> bool:
    g = torch.Generator().manual_seed(0)
    r, scaling = max(ATTENTION_PROBE_ROWS), head_dim**-0.5
    with torch.inference_mode():
        for w in ATTENTION_PROBE_WIDTHS:
            q, k, v = (torch.randn(r, kv_heads, n, head_dim, generator=g).to(device, dtype)
                       for n in (group, w, w))
            seen = torch.randint(max(1, w - KEY_BLOCK + 1), w + 1, (r,), generator=g)
            hidden = (torch.arange(w)[None] >= seen[:, None]).to(device)  # [R, W]

            def attend(q, k, v, m=r, visible=~hidden[:, None]):
                return row_attention(q[:m], k[:m], v[:m], visible[:m], scaling, kernel)

            ref = attend(q, k, v)
            # as a tree's call: its queries a transposed view, its gathered keys contiguous
            k_first, v_first = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
            tree = row_attention(q.transpose(0, 1), k_first, v_first, ~hidden[None], scaling, kernel)
            masked = hidden[:, None, :, None]
            if not (all(torch.equal(attend(q, k, v, m), ref[:m]) for m in ATTENTION_PROBE_ROWS)
                    and torch.equal(tree.transpose(0, 1), ref)
                    and torch.equal(attend(q, k.masked_fill(masked, 3.0), v.masked_fill(masked, -2.0)), ref)):
                return False
    return True


@functools.cache
def pick_attention_kernel(kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
                          device: str = "cpu") -> str:
    """The first of ``ATTENTION_KERNELS`` whose rows agree at these shapes ("eager" always does).

    "native" only in bf16 on a CPU where it is built: in fp32 the engine's AR also equals
    transformers' own ``generate`` (whose SDPA rounds as torch's does), a promise a kernel
    with its own exp would have to earn prompt by prompt."""
    def candidate(k: str) -> bool:
        if k == "native":
            fits = group <= native_rows.MAX_GROUP and head_dim <= native_rows.MAX_HEAD_DIM
            on_cpu = torch.device(device).type == "cpu"
            return dtype == torch.bfloat16 and on_cpu and fits and native_rows.available()
        return True

    return next(k for k in ATTENTION_KERNELS if candidate(k)
                and (k == "eager" or attention_rows_agree(k, kv_heads, group, head_dim, dtype, device)))
