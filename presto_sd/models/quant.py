"""The GGUF's own 4-bit weights as the verifier's linears: Q4_1 through torch's int4 CPU kernel.

Q4_1 stores each run of 32 weights along a row as 4-bit ``q`` with an fp16 scale ``d`` and
minimum ``m``: ``w = d * q + m``. torch's int4 weight-only kernel
(``_weight_int4pack_mm_for_cpu``) computes ``w = (q - 8) * scale + zero`` per group of 32,
so ``scale = d`` and ``zero = m + 8 d`` express Q4_1 with no new rounding of ``q``; the
scales are held in the activations' dtype (bf16), so the weights the kernel sees are the
GGUF's to bf16 precision of ``d`` and ``m + 8 d``, not the dequantized bf16 weights the
dense path loads (``scripts/int4_probe.py`` measures both). A step reads 4.5 bits a weight
instead of 16 or 32.

The head comes from the GGUF too where it is Q8_0 (SmolLM2's tied ``token_embd``): ``Q8Head``
runs its 8-bit values as two 4-bit planes through the same kernel, fp32 logits.

Lossless still means what it means everywhere here: the kernel's rows are probed
(``rows_agree``) for every shape before the mode is used, and AR and every speculative
method run the same kernels, so greedy output is bitwise this mode's own AR.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from presto_sd.models.invariant import PROBE_ROWS, fusion_agrees, rows_agree_in

if TYPE_CHECKING:
    import gguf

GROUP = 32  # Q4_1's block: weights per (d, m) pair, along the input dimension
# the int4 kernel computes rows 4 at a time, re-dequantizing the weights for each 4: 1-4 rows
# cost about one block, 5 about two (scripts/int4_probe.py); what a tree's walk batches
ROW_BLOCK = 4
WEIGHTS = ("dense", "gguf-int4")  # the verifier's linear weights: the loaded model's, or the GGUF's Q4_1

# GGUF tensor names of a Llama block -> the module they load into (under ``model.layers.{i}``)
_GGUF_TO_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


_FUSION_PROBED: dict[tuple, bool] = {}  # Int4Linear.fuse's probe, per shape signature


def _probe_rows(in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The random rows every int4 probe here multiplies (``max(PROBE_ROWS)`` of them)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(max(PROBE_ROWS), in_features, generator=g).to(dtype)


class QuantError(ValueError):
    """A model whose weights cannot run this way (no Q4_1 blocks, a mismatch, no invariant kernel)."""


@dataclass(frozen=True)
class Q4Blocks:
    """One Q4_1 weight ``[out, in]``: ``q`` int32 in 0..15, ``d`` and ``m`` fp32 ``[out, in / 32]``."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """``d * q + m`` in fp32: what gguf's own dequantize gives, and the dense path loads."""
        n, k = self.q.shape
        return (self.q.float().view(n, k // GROUP, GROUP) * self.d[..., None] + self.m[..., None]).view(n, k)

    def rows(self, order: torch.Tensor) -> Q4Blocks:
        """The blocks of output rows ``order`` (groups run along the input: rows move whole)."""
        return Q4Blocks(self.q[order], self.d[order], self.m[order])

    @classmethod
    def from_gguf(cls, raw: np.ndarray, n: int, k: int) -> Q4Blocks:
        """A Q4_1 tensor's raw bytes: per block ``d`` (fp16), ``m`` (fp16), then 16 bytes whose
        low nibbles are weights 0..15 and high nibbles weights 16..31."""
        blocks = np.asarray(raw).reshape(n, k // GROUP, 20)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nib = blocks[..., 4:]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, k).astype(np.int32)
        return cls(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q4Blocks:
        """Q4_1 of a dense ``[out, in]`` weight as llama.cpp makes it (``d`` = range / 15 and
        ``m`` = the block's minimum, both fp16): for tests and models without a GGUF."""
        n, k = weight.shape
        w = weight.detach().float().view(n, k // GROUP, GROUP)
        lo, hi = w.amin(-1), w.amax(-1)
        d = ((hi - lo) / 15).half().float()
        m = lo.half().float()
        q = torch.where(d[..., None] > 0, ((w - m[..., None]) / d[..., None].clamp_min(1e-30)).round(),
                        torch.zeros_like(w)).clamp(0, 15)
        return cls(q.view(n, k).int(), d, m)


@torch.library.custom_op("presto_sd::int4_mm", mutates_args=())
def _int4_mm_op(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    return torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)


@_int4_mm_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], scales_zeros.shape[1])


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    # in a compiled graph (``compiled.py``) an opaque op: this kernel, not inductor's lowering
    if torch.compiler.is_compiling():
        return _int4_mm_op(x, packed, scales_zeros)
    return torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)


class Int4Linear:
    """``x @ w.T`` with ``w`` the Q4_1 blocks, through torch's int4 CPU kernel in ``dtype``."""

    def __init__(self, blocks: Q4Blocks, dtype: torch.dtype = torch.bfloat16) -> None:
        n, k = blocks.q.shape
        if k % GROUP or n % 8:
            raise QuantError(f"a [{n}, {k}] weight: the int4 kernel needs in % {GROUP} == 0 and out % 8 == 0")
        self.out_features, self.in_features, self.dtype = n, k, dtype
        self.packed = torch._convert_weight_to_int4pack_for_cpu(blocks.q.int().contiguous(), 1)
        zeros = blocks.m + 8 * blocks.d
        # [in / 32, out, 2]: per group and output, the scale and the zero
        self.scales_zeros = torch.stack([blocks.d.t(), zeros.t()], -1).contiguous().to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # rows as they are (the owned decoder's)
            return _int4_mm(x, self.packed, self.scales_zeros)
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        out = _int4_mm(rows, self.packed, self.scales_zeros)
        return out.reshape(*lead, self.out_features)

    @classmethod
    def fuse(cls, parts: list[Int4Linear]) -> Int4Linear | None:
        """One kernel for linears that read the same input (q/k/v, gate/up): their packed rows
        and scales stacked, used where its output is bitwise theirs side by side (probed
        once per shape signature, on these weights); else None."""
        if len({(p.in_features, p.dtype) for p in parts}) != 1:
            return None
        fused = cls.__new__(cls)
        fused.in_features, fused.dtype = parts[0].in_features, parts[0].dtype
        fused.out_features = sum(p.out_features for p in parts)
        fused.packed = torch.cat([p.packed for p in parts])
        fused.scales_zeros = torch.cat([p.scales_zeros for p in parts], 1)
        key = (fused.in_features, tuple(p.out_features for p in parts), fused.dtype)
        if key not in _FUSION_PROBED:
            _FUSION_PROBED[key] = fusion_agrees(fused, parts, _probe_rows(fused.in_features, fused.dtype))
        return fused if _FUSION_PROBED[key] else None

    def rows_agree(self) -> bool:
        """The dense kernels' probe (``invariant.rows_agree_in``), for this kernel and these weights."""
        return rows_agree_in(self, _probe_rows(self.in_features, self.dtype))


class Q8Head:
    """The GGUF's Q8_0 output matrix (SmolLM2's: ``token_embd``, tied) as the lm_head through
    the int4 kernel: Q8_0 is ``w = d * q`` per 32 weights with ``q`` int8, and
    ``q + 128 = 16 hi + lo`` splits it into two 4-bit planes, ``hi`` with scale ``16 d`` and
    zero ``0`` ((hi - 8) 16 d), ``lo`` with scale ``d`` and zero ``8 d`` (lo d): their sum is
    ``d q`` exactly in real arithmetic. Reads 1 byte a weight instead of bf16's 2, and the
    kernel's lone row costs ~1.6 ms against bf16's ~4.0 on a 2-vCPU EPYC (both planes; 4 rows
    3.3 against 4.0, 5 rows 5.5 against 4.1: a random-weight microbenchmark of the head's
    shape). Logits in fp32 (the planes' sum), row-invariant where both planes are (probed)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> None:
        u = (q.int() + 128).contiguous()
        hi, lo = u >> 4, u & 15
        self.hi = Int4Linear(Q4Blocks(hi, 16 * d, -128 * d), dtype)
        self.lo = Int4Linear(Q4Blocks(lo, d, torch.zeros_like(d)), dtype)
        self.in_features, self.out_features, self.dtype = q.shape[1], q.shape[0], dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.hi(x).float() + self.lo(x).float()

    def rows_agree(self) -> bool:
        return rows_agree_in(self, _probe_rows(self.in_features, self.dtype))


def q8_0_blocks(raw: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's raw bytes -> (``q`` int32 ``[n, k]`` in -128..127, ``d`` fp32
    ``[n, k / 32]``): per block ``d`` (fp16), then 32 int8 weights."""
    blocks = np.asarray(raw).reshape(n, k // GROUP, 34)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(n, k).astype(np.int32))
    return q, d


def open_gguf(source: str | Path | gguf.GGUFReader) -> gguf.GGUFReader:
    """A ``gguf.GGUFReader`` of ``source`` (a path), or ``source`` itself where it is one:
    parsing the file's header costs seconds, so a caller reading the head and the linears
    opens it once."""
    import gguf

    return source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(str(source))


def gguf_q8_0_head(source: str | Path | gguf.GGUFReader, model: torch.nn.Module,
                   dtype: torch.dtype = torch.bfloat16) -> Q8Head | None:
    """The GGUF's output matrix as a ``Q8Head`` where it is Q8_0 (``output``, else the tied
    ``token_embd``), checked against the loaded lm_head (its dequantized values, in the model's
    dtype) and probed row-invariant; None where the file's head is another type (the dense
    head stays). ``source``: the file's path or its ``open_gguf`` reader."""
    import gguf

    reader = open_gguf(source)
    tensors = {t.name: t for t in reader.tensors}
    t = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if t is None or t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        return None
    k, n = (int(x) for x in t.shape)
    q, d = q8_0_blocks(t.data, n, k)
    weight = model.get_output_embeddings().weight.detach().cpu()
    dense = (q.float().view(n, k // GROUP, GROUP) * d[..., None]).view(n, k)
    if not torch.equal(dense.to(weight.dtype), weight):
        raise QuantError("the GGUF's Q8_0 head is not the loaded lm_head (another file?)")
    head = Q8Head(q, d, dtype)
    if not head.rows_agree():
        raise QuantError(f"the int4 kernel rounds a row by its batch at the head's shape {(k, n)} here")
    return head


def _reverse_permute(blocks: Q4Blocks, heads: int) -> Q4Blocks:
    """Undo llama.cpp's converter's reordering of q / k rows for its RoPE (transformers'
    GGUF loader undoes it the same way on the dequantized weight)."""
    n = blocks.q.shape[0]
    dim = n // heads // 2
    order = torch.arange(n).view(heads, dim, 2).transpose(1, 2).reshape(n)  # new (h, j, i) <- old (h, i, j)
    return blocks.rows(order)


def gguf_q4_1_blocks(source: str | Path | gguf.GGUFReader, config) -> dict[str, Q4Blocks]:
    """Every Q4_1 linear of a Llama-family GGUF, keyed by its module under the decoder
    (``layers.{i}.self_attn.q_proj`` ...), rows in transformers' order. ``source``: the
    file's path or its ``open_gguf`` reader."""
    import gguf

    reader = open_gguf(source)
    arch = reader.fields["general.architecture"]
    # llama.cpp's converter reorders q / k rows for the llama architecture only
    permuted = bytes(arch.parts[arch.data[0]]).decode() == "llama"
    out: dict[str, Q4Blocks] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        q4_1 = t.tensor_type == gguf.GGMLQuantizationType.Q4_1
        if not q4_1 or parts[0] != "blk" or parts[2] not in _GGUF_TO_HF:
            continue
        k, n = (int(s) for s in t.shape)  # gguf lists [in, out]
        blocks = Q4Blocks.from_gguf(t.data, n, k)
        if permuted and parts[2] == "attn_q":
            blocks = _reverse_permute(blocks, config.num_attention_heads)
        elif permuted and parts[2] == "attn_k":
            blocks = _reverse_permute(blocks, config.num_key_value_heads)
        out[f"layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}"] = blocks
    return out


def int4_linears(blocks: dict[str, Q4Blocks], model: torch.nn.Module,
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, Int4Linear]:
    """The kernels for ``blocks``, each checked against the loaded model: its dequantized
    weight must be the module's weight (rounded to the model's dtype: the same tensor
    the loader made), and its rows must agree in every call size. Every linear of every
    layer must be there: a half-quantized model is refused."""
    decoder = model.get_decoder()
    wanted = {name for name, m in decoder.named_modules()
              if isinstance(m, torch.nn.Linear) and name.startswith("layers.")}
    if set(blocks) != wanted:
        missing, extra = sorted(wanted - set(blocks)), sorted(set(blocks) - wanted)
        raise QuantError(f"the GGUF's Q4_1 linears do not cover the model: missing {missing[:4]}, "
                         f"unknown {extra[:4]}")
    out: dict[str, Int4Linear] = {}
    probed: dict[tuple[int, int], bool] = {}
    for name, b in blocks.items():
        module = decoder.get_submodule(name)
        if module.bias is not None:
            raise QuantError(f"{name} has a bias: the int4 path runs bias-free linears only")
        if not torch.equal(b.dequantize().to(module.weight.dtype), module.weight.detach().cpu()):
            raise QuantError(f"{name}: the GGUF's blocks are not the loaded weight (another file?)")
        lin = Int4Linear(b, dtype)
        shape = (lin.in_features, lin.out_features)
        if shape not in probed:
            probed[shape] = lin.rows_agree()
        if not probed[shape]:
            raise QuantError(f"the int4 kernel rounds a row by its batch at {shape} here: not lossless")
        out[name] = lin
    return out

