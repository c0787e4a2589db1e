"""The self-speculative adapter: the target drafts its own next block at mask rows.

SmolLM2 has no diffusion mode, so it is given one that cannot change what it computes for
real tokens (docs/self_speculative.md; "Your LLM Knows the Future", arXiv 2507.11851): a
learned mask embedding, and a low-rank delta ``B(A x)`` added to every linear's output at
mask rows only. Real rows never attend to mask rows (they are leaves of the tree
attention), so every real row is computed exactly as without the adapter.

A chain of ``depth`` mask rows hangs after a token at position ``p``: mask ``j`` sits at
position ``p + j`` and sees the committed prefix, the token's path and masks ``1..j``
(causal, as every row of an AR model); its output is the distribution of the token at
``p + j + 1``. The token's own row gives ``p + 1`` (the round's bonus), so the chain's rows
are the marginals of depths ``1..depth`` of the next block, rooted at that bonus: exactly
the layout of a drafter's ``[anchor, MASK x (L-1)]`` block, without seeing the anchor.

``mask_chain_forward`` is the same arithmetic in autograd (training; ``train_self``); the
verifier runs it inside the owned decoder (``llama.LlamaDecoder``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half  # the reference arithmetic

from presto_sd.models.assets import DIGESTS_FILE, file_digests

# every linear of a Llama-family layer, as named under the layer
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
CONFIG_FILE, WEIGHTS_FILE = "self_draft.json", "adapter.safetensors"


@dataclass(frozen=True)
class SelfDraftConfig:
    target: str  # the target it was trained on (its name or path)
    hidden_size: int
    num_layers: int
    block: int  # the deepest chain it was trained for: depths 1..block of the next block
    rank: int = 16
    alpha: float = 32.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class SelfDraftAdapter(nn.Module):
    """The mask embedding and the low-rank deltas of every layer's linears."""

    def __init__(self, config: SelfDraftConfig, shapes: dict[str, tuple[int, int]]) -> None:
        """``shapes``: (in, out) of each name of ``LINEARS``."""
        super().__init__()
        self.config = config
        self.mask_embed = nn.Parameter(torch.zeros(config.hidden_size))
        self.lora_a = nn.ParameterDict()
        self.lora_b = nn.ParameterDict()
        for layer in range(config.num_layers):
            for name in LINEARS:
                d_in, d_out = shapes[name]
                key = _key(layer, name)
                a = torch.empty(config.rank, d_in)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
                self.lora_a[key] = nn.Parameter(a)
                self.lora_b[key] = nn.Parameter(torch.zeros(d_out, config.rank))  # starts as the base

    @classmethod
    def for_model(cls, model, block: int, rank: int = 16, alpha: float = 32.0,
                  target: str = "") -> SelfDraftAdapter:
        """A fresh adapter for ``model``: the delta zero, the mask embedding the mean token's."""
        layer = model.get_decoder().layers[0]
        shapes = {name: (m.in_features, m.out_features)
                  for name in LINEARS for m in [layer.get_submodule(name)]}
        c = model.config
        adapter = cls(SelfDraftConfig(target or c.name_or_path, c.hidden_size, c.num_hidden_layers,
                                      block, rank, alpha), shapes)
        with torch.no_grad():
            adapter.mask_embed.copy_(model.get_input_embeddings().weight.float().mean(0))
        return adapter

    def delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        """The low-rank term of linear ``name`` of ``layer`` for mask rows ``x [..., in]``."""
        key = _key(layer, name)
        a, b = self.lora_a[key], self.lora_b[key]
        return F.linear(F.linear(x.to(a.dtype), a), b) * self.config.scale

    # -- files ------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path / WEIGHTS_FILE))
        shapes = {name: [self.lora_a[_key(0, name)].shape[1], self.lora_b[_key(0, name)].shape[0]]
                  for name in LINEARS}  # (in, out)
        config = {**asdict(self.config), "shapes": shapes}
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype = torch.float32) -> SelfDraftAdapter:
        """The adapter saved in ``path``; FileNotFoundError / ValueError naming what is wrong."""
        cfg_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
        for f in (cfg_file, weights):
            if not f.is_file():
                raise FileNotFoundError(f"{path}: no {f.name} (not a self-draft adapter dir: "
                                        "`presto-sd train self-draft --out DIR` makes one)")
        digests = path / DIGESTS_FILE  # a shipped dir: its files are the ones it names
        if digests.exists():
            want, have = json.loads(digests.read_text()), file_digests(path)
            bad = sorted(f for f, d in want.items() if have.get(f) != d)
            if bad:
                raise ValueError(f"self-draft adapter {path}: {', '.join(bad)} missing or differing from "
                                 f"{DIGESTS_FILE} (a partial checkout, an edit, or Git LFS pointers)")
        raw = json.loads(cfg_file.read_text())
        shapes = {name: tuple(s) for name, s in raw.pop("shapes").items()}
        adapter = cls(SelfDraftConfig(**raw), shapes)
        adapter.load_state_dict(load_file(str(weights)))  # strict: a missing layer is an error
        return adapter.to(dtype).eval().requires_grad_(False)

    def check_target(self, model) -> None:
        c = model.config
        if (c.hidden_size, c.num_hidden_layers) != (self.config.hidden_size, self.config.num_layers):
            raise ValueError(
                f"self-draft adapter for hidden {self.config.hidden_size} x {self.config.num_layers} layers "
                f"({self.config.target}); the target has {c.hidden_size} x {c.num_hidden_layers}")


def _key(layer: int, name: str) -> str:
    return f"{layer}_{name.replace('.', '_')}"


# LINEARS by the input they share in a layer: q/k/v, o, gate/up, down
GROUPS = ((0, 1, 2), (3,), (4, 5), (6,))


class MaskRowDeltas:
    """The adapter as the verifier's forward applies it (``llama.LlamaDecoder``): per layer and
    input group (``GROUPS``) the A matrices stacked, ``[g * rank, in]``, and the scaled B
    matrices as one block-diagonal ``[g * rank, sum of outs]``: two matmuls a group, fp32
    (the fast path for these small shapes on a CPU). ``add`` puts a group's deltas into its
    outputs at the mask rows, in place; other rows are not touched."""

    def __init__(self, adapter: SelfDraftAdapter, device: torch.device) -> None:
        c = adapter.config
        self.mask_embed = adapter.mask_embed.detach().to(device)

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device, torch.float32).contiguous()

        self.a = [[w(torch.cat([adapter.lora_a[_key(i, LINEARS[j])] for j in g])).T.contiguous()
                   for g in GROUPS] for i in range(c.num_layers)]  # [in, g * rank]
        self.b = [[w(torch.block_diag(*[adapter.lora_b[_key(i, LINEARS[j])].float().T * c.scale for j in g]))
                   for g in GROUPS] for i in range(c.num_layers)]  # [g * rank, sum of outs]

    def add(self, layer: int, group: int, x: torch.Tensor, outs: Sequence[torch.Tensor],
            rows: torch.Tensor) -> None:
        """``x [N, in]`` the group's input, ``outs`` its linears' outputs ``[N, out]``."""
        delta = (x.index_select(0, rows).float() @ self.a[layer][group]) @ self.b[layer][group]
        start = 0
        for out in outs:  # [m, sum of outs]: each output's columns in turn
            width = out.shape[-1]
            out.index_add_(0, rows, delta[:, start : start + width].to(out.dtype))
            start += width


# ----------------------------------------------------------------------------- training


def chain_positions(hang: torch.Tensor, depth: int) -> torch.Tensor:
    """Positions of the mask chains after the tokens at ``hang [B, A]``: ``[B, A * depth]``."""
    j = torch.arange(1, depth + 1, device=hang.device)
    return (hang[..., None] + j).flatten(1)


def chain_attention_mask(hang: torch.Tensor, depth: int, real_len: int) -> torch.Tensor:
    """Bool ``[B, 1, A*depth, real_len + A*depth]``: which keys each mask row sees — the real
    tokens up to its chain's hang position, and its own chain's masks up to itself."""
    b, a = hang.shape
    rows = a * depth
    real = torch.arange(real_len, device=hang.device)
    sees_real = real[None, None, :] <= hang.repeat_interleave(depth, dim=1)[..., None]  # [B, rows, T]
    chain = torch.arange(rows, device=hang.device) // depth
    step = torch.arange(rows, device=hang.device) % depth
    sees_mask = (chain[:, None] == chain[None, :]) & (step[None, :] <= step[:, None])  # [rows, rows]
    return torch.cat([sees_real, sees_mask[None].expand(b, rows, rows)], dim=-1)[:, None]


def real_pass(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The target over real tokens ``ids [B, T]`` as it is (no adapter): its final normed hidden
    states ``[B, T, H]`` and per layer the keys/values after RoPE ``[B, kv_heads, T, head_dim]``,
    what ``mask_chain_forward`` attends to."""
    out = model.get_decoder()(input_ids=ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values  # transformers' name, either version
    return out.last_hidden_state, [(layer.keys, layer.values) for layer in cache.layers]


def mask_chain_forward(model, adapter: SelfDraftAdapter, real_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                       hang: torch.Tensor, depth: int) -> torch.Tensor:
    """The final normed hidden states ``[B, A*depth, H]`` of mask chains after ``hang [B, A]``,
    attending to ``real_kv`` (``real_pass``: per layer the real tokens' keys/values after RoPE)
    and to their own chain: in autograd, the
    adapter's parameters the only ones with gradients.

    The same arithmetic as the owned decoder's mask rows (``llama.LlamaDecoder``), written
    for a batch: a Llama layer with the adapter's delta on every linear."""
    inner = model.get_decoder()
    c = model.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    b, a = hang.shape
    rows = a * depth
    dtype = inner.embed_tokens.weight.dtype
    positions = chain_positions(hang, depth)
    h = adapter.mask_embed.to(dtype).expand(b, rows, -1)
    cos, sin = inner.rotary_emb(h, positions)
    cos, sin = cos[:, None], sin[:, None]
    allowed = chain_attention_mask(hang, depth, real_kv[0][0].shape[2])

    def lin(i: int, name: str, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return module(x) + adapter.delta(i, name, x).to(x.dtype)

    for i, layer in enumerate(inner.layers):
        at, mlp = layer.self_attn, layer.mlp
        x = layer.input_layernorm(h)
        q = lin(i, LINEARS[0], at.q_proj, x).view(b, rows, heads, head_dim)
        k = lin(i, LINEARS[1], at.k_proj, x).view(b, rows, kv_heads, head_dim)
        v = lin(i, LINEARS[2], at.v_proj, x).view(b, rows, kv_heads, head_dim)
        if getattr(at, "q_norm", None) is not None:
            q, k = at.q_norm(q), at.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys = torch.cat([real_kv[i][0].to(k.dtype), k], dim=2)
        values = torch.cat([real_kv[i][1].to(v.dtype), v], dim=2)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=at.scaling,
                                              enable_gqa=kv_heads != heads)
        h = h + lin(i, LINEARS[3], at.o_proj, attn.transpose(1, 2).reshape(b, rows, -1))
        x = layer.post_attention_layernorm(h)
        gate = lin(i, LINEARS[4], mlp.gate_proj, x)
        up = lin(i, LINEARS[5], mlp.up_proj, x)
        h = h + lin(i, LINEARS[6], mlp.down_proj, F.silu(gate) * up)
    return inner.norm(h)

