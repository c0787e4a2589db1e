"""The verifier's own decoder forward for the Llama family (SmolLM2, Llama, Qwen2, Qwen3).

One page, the call a reader sees is the call that runs (gpt-fast's ``model.py``): the
packed tokens go through embedding, per layer RMSNorm -> q/k/v (one matmul) -> RoPE -> the
packed attention (``packed.session_attention``: per-session slots, row attention for decode
rows) -> o -> residual -> RMSNorm -> gate/up (one matmul) -> SiLU -> down -> residual, and
the final norm. Every linear is ``invariant_linear`` with the kernel probed for its shape
(or the GGUF's int4 blocks, ``quant``); q/k/v and gate/up are fused only where a probe finds
the stacked matmul bitwise the separate ones (``invariant.fusion_agrees``). Every other op is
transformers' own arithmetic (RMSNorm in fp32, RoPE from the model's own rotary module, its
``rotate_half`` as a roll against a signed sin: the same products), so the result is bitwise
the transformers path that it replaces, and what it drops is that path's Python: module
calls, mask and cache machinery, output records, per-linear reshapes and pads (rows stay 2-D;
an AR step runs as two rows, ``pad_lone_row``). Ops per AR step: ``scripts/op_count.py``.
The weights are the loaded model's tensors, shared, not copied (fused ones are stacked and
the modules' weights made views of them); transformers stays for loading, tokenizers and as
the test reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from presto_sd.models.compiled import CompiledForward
from presto_sd.models.invariant import fusion_kernel_agrees, invariant_linear, pick_linear_kernel
from presto_sd.models.packed import packed_plan, session_attention
from presto_sd.models.quant import Int4Linear
from presto_sd.models.self_draft import MaskRowDeltas, SelfDraftAdapter

FAMILY = ("llama", "qwen2", "qwen3")  # model_type values this decoder runs


@dataclass(frozen=True)
class _Linear:
    weight: torch.Tensor
    bias: torch.Tensor | None
    kernel: str

    @classmethod
    def of(cls, m: torch.nn.Linear) -> _Linear:
        w = m.weight
        return cls(w, m.bias, pick_linear_kernel(w.shape[1], w.shape[0], w.dtype, w.device.type) or "aten")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias, self.kernel)

    @classmethod
    def fuse(cls, modules: Sequence[torch.nn.Linear]) -> _Linear | None:
        """One matmul for modules that read the same input, where the probe finds its output
        bitwise theirs side by side; the modules' weights become views of the stacked one
        (no second copy). None where they differ in kernel, dtype or bias, or it disagrees."""
        parts = [cls.of(m) for m in modules]
        w0, outs = parts[0].weight, tuple(p.weight.shape[0] for p in parts)
        if (len({(p.kernel, p.weight.dtype, p.weight.shape[1], p.bias is None) for p in parts}) != 1
                or not fusion_kernel_agrees(parts[0].kernel, w0.shape[1], outs, w0.dtype, w0.device.type)):
            return None
        weight = torch.cat([m.weight.detach() for m in modules])
        bias = None if parts[0].bias is None else torch.cat([m.bias.detach() for m in modules])
        sizes = [m.out_features for m in modules]
        for m, w in zip(modules, weight.split(sizes)):
            m.weight.data = w
        if bias is not None:
            for m, b in zip(modules, bias.split(sizes)):
                m.bias.data = b
        return cls(weight, bias, parts[0].kernel)


Linear = Callable[[torch.Tensor], torch.Tensor]  # rows [..., in] -> [..., out], each row as alone


@dataclass(frozen=True)
class _Stacked:
    """Linears that read the same input, run one by one, outputs side by side (where no
    fused matmul agrees with them)."""

    parts: tuple[Linear, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([f(x) for f in self.parts], -1)


def _fused(modules: Sequence[torch.nn.Linear], given: Sequence[Linear | None]) -> Linear:
    """One linear for ``modules`` (q/k/v, or gate/up): their own weights, or the ``given``
    kernels (all or none), fused where a probe says the output is bitwise the parts'."""
    if all(g is None for g in given):
        fused = _Linear.fuse(modules)
    elif all(isinstance(g, Int4Linear) for g in given):
        fused = Int4Linear.fuse(list(given))
    else:
        fused = None
    return fused or _Stacked(tuple(g or _Linear.of(m) for g, m in zip(given, modules)))


@dataclass(frozen=True)
class _Layer:
    attn: torch.nn.Module  # read for layer_idx / scaling by the attention; never called
    input_norm: torch.Tensor
    qkv: Linear  # q, k and v side by side: one matmul (vLLM's QKVParallelLinear)
    qkv_sizes: tuple[int, int, int]
    o: Linear
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over each head before RoPE
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Linear  # gate and up side by side: one matmul
    down: Linear


def supports(model: PreTrainedModel) -> bool:
    """Does this decoder run ``model`` (a Llama-family causal LM with SiLU MLPs)?"""
    c = model.config
    return c.model_type in FAMILY and getattr(c, "hidden_act", "silu") == "silu"


class LlamaDecoder:
    """The decoder stack of a loaded Llama-family model, as one plain forward.

    ``linears``: kernels that replace the model's own, by module name under the decoder
    (``layers.3.mlp.up_proj``): the GGUF's int4 blocks (``quant.int4_linears``).
    ``adapter``: the self-speculative adapter, applied to the rows a forward names as mask
    rows only (``self_draft.py``); every other row is computed as without it.
    ``compile``: the forwards of AR steps through torch.compile, where bitwise this eager
    forward (``compiled.py``: an engine option, level with eager end to end for now)."""

    def __init__(self, model: PreTrainedModel, linears: Mapping[str, Linear] | None = None,
                 adapter: SelfDraftAdapter | None = None, compile: bool = False) -> None:
        if not supports(model):
            raise ValueError(f"{model.config.model_type!r} is not a Llama-family model: {FAMILY}")
        inner = model.get_decoder()
        c = model.config
        self.dims = _Dims(c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads,
                          getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight
        self.layers = [self._layer(i, layer, linears or {}) for i, layer in enumerate(inner.layers)]
        # the dense kernels compute a lone row as one of two (``invariant_linear``): an AR step
        # runs as two rows from the start (its row twice; the second is never attended or
        # read), so no linear pads and slices on its own. Row invariance makes the copy's
        # values irrelevant to the real row. The int4 kernel's lone row is probed as it is.
        self.pad_lone_row = any(not isinstance(f, Int4Linear) for layer in self.layers
                                for f in (layer.qkv, layer.o, layer.gate_up, layer.down))
        if adapter is not None:
            adapter.check_target(model)
        self.deltas = MaskRowDeltas(adapter, self.embed.device) if adapter is not None else None
        # AR steps' layers compiled whole, where bitwise the eager ones (``compiled.py``)
        self.compiled = CompiledForward(self.layers_forward) if compile else None

    @staticmethod
    def _layer(i: int, layer: torch.nn.Module, linears: Mapping[str, Linear]) -> _Layer:
        a, m = layer.self_attn, layer.mlp

        def given(*names: str) -> list[Linear | None]:
            return [linears.get(f"layers.{i}.{name}") for name in names]

        def lin(name: str, module: torch.nn.Linear) -> Linear:
            return given(name)[0] or _Linear.of(module)

        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        qkv = (a.q_proj, a.k_proj, a.v_proj)
        return _Layer(a, layer.input_layernorm.weight,
                      _fused(qkv, given("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                      tuple(p.out_features for p in qkv), lin("self_attn.o_proj", a.o_proj),
                      None if qn is None else qn.weight, None if kn is None else kn.weight,
                      layer.post_attention_layernorm.weight,
                      _fused((m.gate_proj, m.up_proj), given("mlp.gate_proj", "mlp.up_proj")),
                      lin("mlp.down_proj", m.down_proj))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, plan,
                keep_layers: Sequence[int] = (), mask_rows: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``input_ids``/``positions`` ``[N]`` of the packed tokens -> (the final normed hidden
        states ``[N, H]``, the outputs of ``keep_layers`` ``[N, H]`` each, in that order, as
        transformers' ``hidden_states[i + 1]``). ``mask_rows``: indices of the self-draft mask
        rows (their ``input_ids`` are ignored), which the adapter computes."""
        real = input_ids.shape[0]
        if real == 1 and self.pad_lone_row:
            input_ids, positions = input_ids.repeat(2), positions.repeat(2)
        h = self.embed[input_ids]  # [N, H]: the linears' rows as they are, no reshapes
        deltas = None  # the adapter, at mask rows only: every other row is the linears' alone
        if mask_rows is not None and len(mask_rows) > 0:
            if self.deltas is None:
                raise ValueError("mask rows need a self-draft adapter")
            deltas = self.deltas
            h[mask_rows] = deltas.mask_embed.to(h.dtype)
        # eager always: inductor's vectorized cos rounds its own way
        cos, sin = self.rotary(h, positions[None])  # [1, N, head_dim], in h's dtype
        # transformers' q * cos + rotate_half(q) * sin with rotate_half(q) = cat(-q2, q1) as
        # roll(q) * cat(-sin1, sin2): the same products ((-a) b = -(a b) exactly), one op not four
        half = self.dims.head_dim // 2
        cos, sin = cos[:, None], torch.cat([-sin[..., :half], sin[..., half:]], -1)[:, None]
        keep = tuple(keep_layers)
        if self.compiled is not None and deltas is None and self.compiled.takes(h, plan):
            out, kept = self.compiled(h, cos, sin, plan, keep)
        else:
            out, kept = self.layers_forward(h, cos, sin, plan, keep, deltas, mask_rows)
        return out[:real], [k[:real] for k in kept]

    def layers_forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan,
                       keep_layers: tuple[int, ...], deltas: MaskRowDeltas | None = None,
                       mask_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder layers and the final norm over the embedded rows ``h`` ``[N, H]``
        (what ``compile`` compiles): (the normed output, ``keep_layers``' outputs)."""
        n = h.shape[0]
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            add = None if deltas is None else _layer_deltas(deltas, i, mask_rows)
            q, k, v = _attention_in(self.dims, layer, h, cos, sin, add)
            attn = session_attention(plan, layer.attn, q, k, v, dropout=0.0,
                                     scaling=layer.attn.scaling)  # [1, N, heads, head_dim]
            h = _attention_out(self.dims, layer, h, attn.reshape(n, -1), add)
            if i in keep_layers:
                kept[i] = h
        out = _norm(h, self.final_norm, self.dims.eps)
        # transformers' hidden_states[i + 1], which DFlash's target_layer_ids index: the last
        # layer's entry there is the normed output
        kept[len(self.layers) - 1] = out
        return out, [kept[i] for i in keep_layers]


@dataclass(frozen=True)
class _Dims:
    eps: float
    heads: int
    kv_heads: int
    head_dim: int


Deltas = Callable[[int, torch.Tensor, tuple[torch.Tensor, ...]], None]  # (group, input, outputs)


def _layer_deltas(deltas: MaskRowDeltas, layer: int, rows: torch.Tensor) -> Deltas:
    return lambda group, x, outs: deltas.add(layer, group, x, outs, rows)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm, op for op: fp32 statistics, the weight in the input dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(_mean_square(h) + eps)
    return weight * h.to(x.dtype)


def _mean_square(h: torch.Tensor) -> torch.Tensor:
    # compiled (``compiled.py``): an opaque op, ATen's reduction order (inductor sums its own way)
    if torch.compiler.is_compiling():
        return _mean_square_op(h)
    return h.pow(2).mean(-1, keepdim=True)


@torch.library.custom_op("presto_sd::mean_square", mutates_args=())
def _mean_square_op(h: torch.Tensor) -> torch.Tensor:
    return h.pow(2).mean(-1, keepdim=True)


@_mean_square_op.register_fake
def _(h: torch.Tensor) -> torch.Tensor:
    return h.new_empty(*h.shape[:-1], 1)


def _attention_in(c: _Dims, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  deltas: Deltas | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer up to its attention: RMSNorm -> q/k/v -> (Qwen3's q/k norms) -> RoPE; h ``[N, H]``
    -> q ``[1, heads, N, head_dim]``, k and v ``[1, kv_heads, N, head_dim]``."""
    n = h.shape[0]
    x = _norm(h, layer.input_norm, c.eps)
    qkv = layer.qkv(x)
    if deltas is not None:
        deltas(0, x, (qkv,))
    q, k, v = qkv.split(layer.qkv_sizes, -1)
    q = q.view(1, n, c.heads, c.head_dim)
    k = k.view(1, n, c.kv_heads, c.head_dim)
    v = v.view(1, n, c.kv_heads, c.head_dim)
    if layer.q_norm is not None:
        q, k = _norm(q, layer.q_norm, c.eps), _norm(k, layer.k_norm, c.eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    half = c.head_dim // 2
    q = q * cos + q.roll(half, -1) * sin
    k = k * cos + k.roll(half, -1) * sin
    return q, k, v


def _attention_out(c: _Dims, layer: _Layer, h: torch.Tensor, attn: torch.Tensor,
                   deltas: Deltas | None = None) -> torch.Tensor:
    """A layer from its attention's output ``[N, heads * head_dim]``: o -> residual -> RMSNorm ->
    gate/up -> SiLU -> down -> residual; returns the layer's output ``[N, H]``."""
    o = layer.o(attn)
    if deltas is not None:
        deltas(1, attn, (o,))
    h = h + o
    x = _norm(h, layer.post_norm, c.eps)
    gate_up = layer.gate_up(x)
    if deltas is not None:
        deltas(2, x, (gate_up,))
    gate, up = gate_up.chunk(2, -1)
    act = torch.nn.functional.silu(gate) * up
    down = layer.down(act)
    if deltas is not None:
        deltas(3, act, (down,))
    return h + down


__all__ = ["FAMILY", "LlamaDecoder", "packed_plan", "supports"]
