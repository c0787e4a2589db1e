"""The DFlash block-diffusion drafter, in plain PyTorch (docs/design.md §2).

``K`` decoder layers conditioned on the target: target hidden states at
``target_layer_ids`` are concatenated, projected by ``fc`` and normed by ``hidden_norm``;
every layer's K/V is ``[k/v_proj(context) ; k/v_proj(block)]``; queries come from the
block ``[anchor, MASK x (L-1)]`` only, which attends bidirectionally to itself and to all
cached context. Embeddings and ``lm_head`` are the target's own: the drafter owns neither.

Config fields and weight names follow the public DFlash checkpoints
(``architectures: ["DFlashDraftModel"]``, Qwen3-style layers with q/k norms), so a
published checkpoint loads as is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from presto_sd.models.assets import PREFIX_HEAD_FILE
from presto_sd.models.dflash_fields import UnsupportedDrafterConfig, check_supported
from presto_sd.models.session_kv import SessionKV

# a layer's context: K/V tensors shared by every row (training), or one session per row
Context = tuple[torch.Tensor, torch.Tensor] | Sequence[SessionKV]

# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    draft_vocab_size: int | None = None  # a reduced draft vocabulary (token map d2t), if any
    prefix_head_rank: int | None = None  # the prefix-conditioned head (PrefixHead), if any

    @property
    def draft_vocab(self) -> int:
        """Rows of the draft lm_head: the reduced vocabulary, or the target's."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_dict(cls, d: dict) -> DFlashConfig:
        """A published DFlash ``config.json``; what it asks for and this model does not
        compute is refused (``dflash_fields``), never ignored."""
        check_supported(d)
        dflash = d.get("dflash_config", {})
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise UnsupportedDrafterConfig(f"drafter config: rope type {rope} is not supported "
                                           "(default only)")
        layer_ids = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        if layer_ids is None:
            raise ValueError("drafter config: dflash_config.target_layer_ids is required")
        mask = dflash.get("mask_token_id", d.get("mask_token_id"))
        if mask is None:
            raise ValueError("drafter config: dflash_config.mask_token_id is required (the token that "
                             "fills the block's slots after the anchor)")
        if not 0 <= int(mask) < d["vocab_size"]:
            raise ValueError(f"drafter config: mask_token_id = {mask} outside the vocabulary "
                             f"[0, {d['vocab_size']})")
        heads = d["num_attention_heads"]
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            vocab_size=d["vocab_size"],
            block_size=int(dflash.get("block_size", d.get("block_size", 16))),
            mask_token_id=int(mask),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_target_layers=d.get("num_target_layers", max(layer_ids) + 1),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            attention_bias=d.get("attention_bias", False),
            draft_vocab_size=dflash.get("draft_vocab_size"),
            prefix_head_rank=dflash.get("prefix_head_rank"),
        )

    def to_dict(self) -> dict:
        """The DFlash checkpoint's config.json layout."""
        d = asdict(self)
        for k in ("block_size", "mask_token_id", "target_layer_ids", "rope_theta", "draft_vocab_size",
                  "prefix_head_rank"):
            d.pop(k)
        extra = {"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size else {}
        if self.prefix_head_rank:
            extra["prefix_head_rank"] = self.prefix_head_rank
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **d,
            "block_size": self.block_size,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                **extra,
            },
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }


def spread_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """``count`` target layers spread over its depth, from layer 1 to 3 from the top."""
    if count == 1:
        return (num_target_layers // 2,)
    lo, hi = 1, max(1, num_target_layers - 3)
    return tuple(round(lo + i * (hi - lo) / (count - 1)) for i in range(count))


# --------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., T, head_dim] for integer positions [..., T]."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [B, T, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.c = c
        h, hd = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(h, c.num_attention_heads * hd, bias=c.attention_bias)
        self.k_proj = nn.Linear(h, c.num_key_value_heads * hd, bias=c.attention_bias)
        self.v_proj = nn.Linear(h, c.num_key_value_heads * hd, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, h, bias=c.attention_bias)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed, rotated keys and values [B, kv_heads, T, hd] of x [B, T, H]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, -1, self.c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.c.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx: Context, layer: int, mask=None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.c.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        if isinstance(ctx, tuple):  # one context tensor pair for every row (training)
            k, v = torch.cat([ctx[0], k], dim=2), torch.cat([ctx[1], v], dim=2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:  # row r's block after session r's context, read in place (the block is not committed)
            out = torch.cat([
                F.scaled_dot_product_attention(q[r : r + 1], *kv.write(layer, k[r : r + 1], v[r : r + 1]),
                                               enable_gqa=True)
                for r, kv in enumerate(ctx)
            ])
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DFlashMLP(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = DFlashMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: Context, layer: int, mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class PrefixHead(nn.Module):
    """A low-rank correction of block position ``d``'s logits by the token at ``d - 1``.

    DFlash drafts every block position at once, so ``q_d`` is a marginal over all the
    prefixes the drafter thinks likely; a tree knows each node's parent token. This head
    adds ``b_d(t | x) = next[t] . (prev[x] * (1 + gate(h_d)))`` (draft-vocabulary ids; a
    parent outside the draft vocabulary takes the last ``prev`` row), so the children of a
    node are scored by ``q_d(t | x) = softmax(logits_d + b_d(. | x))`` (DSpark's "Markov
    head", with a gate from the position's state). ``next`` starts at zero: an untrained
    head leaves the drafter as it was.
    """

    def __init__(self, draft_vocab: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.prev = nn.Embedding(draft_vocab + 1, rank)
        self.gate = nn.Linear(hidden_size, rank, bias=False)
        self.next = nn.Parameter(torch.zeros(draft_vocab, rank))
        nn.init.normal_(self.prev.weight, std=rank**-0.5)
        nn.init.zeros_(self.gate.weight)

    def forward(self, hidden: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
        """Logit corrections [..., Vd] for states [..., H] and parent draft ids [...] (-1: outside)."""
        unknown = self.prev.num_embeddings - 1
        u = self.prev(torch.where(parent < 0, unknown, parent)) * (1 + self.gate(hidden))
        return u @ self.next.T


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.layers = nn.ModuleList(DFlashDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # draft id -> target id; None = the full target vocabulary (public checkpoints)
        self.d2t: torch.Tensor | None = None
        self.prefix_head = (
            PrefixHead(c.draft_vocab, c.hidden_size, c.prefix_head_rank) if c.prefix_head_rank else None
        )

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V [B, kv_heads, T, hd] of target features [B, T, F]."""
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self.rope(positions)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | Sequence[SessionKV],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Drafter states [B, Q, H] of block embeddings [B, Q, H] at positions [B, Q].

        ``ctx_kv``: per layer the context K/V [B, kv_heads, C, hd] (``context_kv``), or one
        session's buffers per row (inference: each block after its own session's context,
        in place). ``mask`` (bool [B, 1, Q, C + Q], True = attend) is only needed in
        training, where many blocks share one context; at inference a block sees everything.
        """
        cos, sin = self.rope(positions)
        x = block_embeds
        per_session = bool(ctx_kv) and isinstance(ctx_kv[0], SessionKV)
        if per_session:
            for kv in ctx_kv:
                kv.reserve(kv.length + x.shape[1])
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx_kv if per_session else ctx_kv[i], i, mask)
        return self.norm(x)

    def session_kv(self, device: torch.device | str = "cpu") -> SessionKV:
        """Empty context buffers for one session (``DFlashDrafter``)."""
        c = self.config
        return SessionKV(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.fc.weight.dtype, device)

    # -- checkpoints (DFlash format) ----------------------------------------------------
    def save(
        self, path: str | Path, dtype: torch.dtype | None = None, max_file_mb: float | None = None
    ) -> None:
        """Config, weights (in ``dtype`` if given) and the token map; weights are split into
        files of at most ``max_file_mb`` MiB when given (``load`` reads every file).

        The prefix head goes into its own ``prefix_head.safetensors``: a head trained alone
        on a frozen drafter leaves ``model.safetensors`` byte for byte the drafter's, so
        shipping one adds its few MB to a repository, not the drafter's ~25 MB again.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        for old in [*path.glob("model*.safetensors"), path / PREFIX_HEAD_FILE]:
            old.unlink(missing_ok=True)
        self.save_prefix_head(path, dtype)
        state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in self.state_dict().items()
                 if not k.startswith("prefix_head.")}
        limit = int(max_file_mb * 2**20) if max_file_mb else None
        files: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for k, v in state.items():
            nbytes = v.numel() * v.element_size()
            if limit and files[-1] and size + nbytes > limit:
                files.append({})
                size = 0
            files[-1][k] = v
            size += nbytes
        for i, part in enumerate(files):
            n = len(files)
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file(part, path / name, metadata={"format": "pt"})
        if self.d2t is not None:
            save_file({"d2t": self.d2t.cpu().contiguous()}, path / "draft_vocab.safetensors")

    def save_prefix_head(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """The prefix head's weights (in ``dtype`` if given) into ``path/prefix_head.safetensors``;
        nothing without a head."""
        head = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in self.state_dict().items()
                if k.startswith("prefix_head.")}
        if head:
            save_file(head, Path(path) / PREFIX_HEAD_FILE, metadata={"format": "pt"})

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
        path = Path(path)
        config = DFlashConfig.from_dict(json.loads((path / "config.json").read_text()))
        model = cls(config)
        state = {}
        for f in sorted(path.glob("*.safetensors")):
            if f.name != "draft_vocab.safetensors":
                state.update(load_file(f))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing:
            raise ValueError(f"drafter checkpoint {path}: missing weights {missing[:5]}")
        if unexpected:
            raise ValueError(f"drafter checkpoint {path}: unexpected weights {unexpected[:5]}")
        if config.draft_vocab_size:
            model.d2t = load_file(path / "draft_vocab.safetensors")["d2t"].long()
            if len(model.d2t) != config.draft_vocab_size:
                raise ValueError(f"drafter checkpoint {path}: d2t size does not match draft_vocab_size")
        return model.to(dtype).eval()
