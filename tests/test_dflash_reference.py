"""The DFlash drafter against the published format and an independent reference.

A checkpoint is written by hand, not by ``DFlashDraftModel.save``: the fields of the
published ``z-lab/Qwen3-8B-DFlash-b16`` ``config.json`` (sizes shrunk to the tiny target,
every other field kept, in both the transformers-4 ``rope_theta`` and the transformers-5
``rope_parameters`` spelling) and the published weight names, in bfloat16 as published.
It loads through ``--drafter`` and the engine's marginals equal those of
``reference_block_states`` below: the architecture re-implemented from the DFlash paper's
description (arXiv 2602.06036) and the public config, not from ``presto_sd/models/dflash.py``:

- context = RMSNorm_hidden(fc(concat of the target's hidden states after each layer in
  ``target_layer_ids``));
- each draft layer: Qwen3-style pre-norm block; queries from the (normed) block only; keys
  and values from [context ; normed block], RMS-normed per head (q_norm / k_norm) and
  rotated (RoPE, halves paired) at their absolute positions; every block slot attends to
  the whole context and the whole block (no causal mask); grouped-query heads; SiLU MLP;
- final RMSNorm; logits = the target's lm_head; block = [anchor, MASK x (L - 1)] embedded by
  the target's embeddings.

Here in float64 with explicit per-head softmax attention and complex-number RoPE. Config
fields that change semantics are refused (``presto_sd/models/dflash_fields.py``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from presto_sd.embedded.dflash_drafter import DFlashDrafter
from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.models.dflash import DFlashDraftModel
from presto_sd.models.dflash_fields import UnsupportedDrafterConfig
from presto_sd.models.loading import DrafterNotFoundError, load_drafter_model, resolve_drafter
from tests.conftest import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
LAYER_IDS = [1, 2]
BLOCK, MASK = 8, 15

# z-lab/Qwen3-8B-DFlash-b16's config.json, field for field; only sizes and token ids shrunk
PUBLISHED = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": BLOCK,
    "bos_token_id": 0,
    "dflash_config": {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS},
    "dtype": "bfloat16",
    "eos_token_id": 1,
    "head_dim": 16,  # 4 heads x 16 = 64, not the hidden size 32: head_dim is its own field
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 48,
    "layer_types": ["full_attention", "full_attention"],
    "max_position_embeddings": 512,
    "max_window_layers": 2,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_target_layers": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 16,
}
# transformers >= 5 writes RoPE as one dict (as the z-lab DFlash2 checkpoints do)
PUBLISHED_V5 = {**{k: v for k, v in PUBLISHED.items() if k not in ("rope_theta", "rope_scaling")},
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
                "transformers_version": "5.15.0"}

LAYER_WEIGHTS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def published_weights(c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the published names and shapes; norms away from 1 (a swapped or
    skipped norm shows)."""
    g = torch.Generator().manual_seed(seed)
    h, hd, i = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    n_feat = len(c["dflash_config"]["target_layer_ids"]) * h
    shapes = {"fc.weight": (h, n_feat), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for layer in range(c["num_hidden_layers"]):
        p = f"layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = 1 + 0.3 * torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) / math.sqrt(shape[1])
    return {k: v.to(torch.bfloat16) for k, v in out.items()}


def write_checkpoint(path: Path, config: dict, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(published_weights(config, seed), path / "model.safetensors", metadata={"format": "pt"})
    return path


# -- the reference ----------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE of x [T, heads, hd] at positions [T]: dims (j, j + hd/2) as one complex number
    turned by pos * theta^(-2j/hd)."""
    half = x.shape[-1] // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / x.shape[-1])
    turn = torch.polar(torch.ones(len(pos), half, dtype=torch.float64), pos.double()[:, None] * freq)
    z = torch.complex(x[..., :half], x[..., half:]) * turn[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


def reference_block_states(ckpt: Path, features: torch.Tensor, block_embeds: torch.Tensor, *,
                           causal: bool = False, norm_context: bool = False) -> torch.Tensor:
    """Drafter output states [L, H] for context features [C, F] (positions 0..C-1) and block
    embeddings [L, H] (positions C..C+L-1). ``causal`` / ``norm_context``: deliberate flaws
    (a causal block; the context through input_layernorm), to show the comparison sees them."""
    c = json.loads((ckpt / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(ckpt / "model.safetensors").items()}
    eps, hd = c["rms_norm_eps"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    theta = float((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0)))
    n_ctx, n_block = len(features), len(block_embeds)
    pos_q = torch.arange(n_ctx, n_ctx + n_block)
    pos_kv = torch.arange(n_ctx + n_block)
    ctx = _rms(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = block_embeds.double()
    for layer in range(c["num_hidden_layers"]):
        p = f"layers.{layer}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        src = torch.cat([_rms(ctx, w[p + "input_layernorm.weight"], eps) if norm_context else ctx, h])
        q = _rotate(_rms((h @ w[p + "self_attn.q_proj.weight"].T).view(n_block, nh, hd),
                         w[p + "self_attn.q_norm.weight"], eps), pos_q, theta)
        k = _rotate(_rms((src @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd),
                         w[p + "self_attn.k_norm.weight"], eps), pos_kv, theta)
        v = (src @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        heads = []
        for head in range(nh):
            kv_head = head // (nh // nkv)
            scores = q[:, head] @ k[:, kv_head].T / math.sqrt(hd)  # [L, C + L]
            if causal:
                scores = scores.masked_fill(pos_kv[None, :] > pos_q[:, None], -math.inf)
            heads.append(torch.softmax(scores, dim=-1) @ v[:, kv_head])
        x = x + torch.cat(heads, dim=-1) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T  # SiLU-gated
    return _rms(x, w["norm.weight"], eps)


def target_features(target, tokens: list[int]) -> torch.Tensor:
    """The hidden states after each target layer in LAYER_IDS, concatenated [T, F]."""
    with torch.no_grad():
        states = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1][0] for i in LAYER_IDS], dim=-1)  # [0] is the embeddings


# -- the checkpoint loads, and its forward is the reference's ------------------------------------
@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=4)


@pytest.mark.parametrize("config", [PUBLISHED, PUBLISHED_V5], ids=["transformers4", "transformers5"])
def test_a_published_checkpoint_loads_and_drafts_as_the_reference(tmp_path, target, config):
    ckpt = write_checkpoint(tmp_path / "drafter", config)
    model = load_drafter_model(resolve_drafter(str(ckpt), "tiny"), target)  # as --drafter DIR does
    assert model.config.block_size == BLOCK and model.config.mask_token_id == MASK
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    verifier, drafter = HFVerifier(target, model.config.target_layer_ids), DFlashDrafter(model, embed, head)
    prompt = [0, 3, 5, 7, 1, 2]
    pre = verifier.prefill("s", prompt)
    drafter.prefill("s", pre.delta)
    torch.testing.assert_close(pre.delta.features, target_features(target, prompt))

    def check(context: list[int], anchor: int) -> None:
        block = embed[torch.tensor([anchor] + [MASK] * (BLOCK - 1))]
        ref = reference_block_states(ckpt, target_features(target, context), block)[1:]
        m = drafter.marginals(drafter.sessions["s"], anchor, BLOCK - 1, top_k=16)
        torch.testing.assert_close(m.hidden.double(), ref, atol=2e-5, rtol=1e-4)
        ref_logp = torch.log_softmax(ref @ head.double().T, dim=-1)
        torch.testing.assert_close(m.log_probs.double(), ref_logp.gather(1, m.token_ids), atol=1e-4,
                                   rtol=1e-4)
        assert torch.equal(m.token_ids, ref_logp.topk(16).indices)
        # the reference's flawed variants are told apart at this tolerance: the check has teeth
        for flaw in ({"causal": True}, {"norm_context": True}):
            wrong = reference_block_states(ckpt, target_features(target, context), block, **flaw)[1:]
            assert (wrong - ref).abs().max() > 1e-2, flaw

    check(prompt, pre.anchor)
    # a round later: the context cache grew by the verified round's features, at their positions
    d = drafter.draft("s", pre.anchor, pre.base, "marginal", drafter_tree_params())
    res = verifier.verify("s", pre.base, d.tree)
    drafter.commit("s", res.delta)
    check(prompt + [pre.anchor, *res.accepted], res.bonus)


def drafter_tree_params():
    from presto_sd.method.builders import TreeParams

    return TreeParams(budget=8, depth=BLOCK - 1)


def test_the_published_weight_names_are_exactly_the_models(tmp_path):
    """Nothing published is left unread and nothing the model needs is missing (a DFlash
    checkpoint with extra or other tensors is refused by ``load``)."""
    ckpt = write_checkpoint(tmp_path / "drafter", PUBLISHED)
    model = DFlashDraftModel.load(ckpt)
    assert set(model.state_dict()) == set(load_file(ckpt / "model.safetensors"))
    extra = {**load_file(ckpt / "model.safetensors"), "candidate_selector.hidden_projection.weight":
             torch.zeros(4, 32, dtype=torch.bfloat16)}
    save_file(extra, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected weights.*candidate_selector"):
        DFlashDraftModel.load(ckpt)


# -- fields that change semantics: refused, naming the field ------------------------------------
def _with(**changes) -> dict:
    cfg = json.loads(json.dumps(PUBLISHED))
    for key, value in changes.items():
        if key.startswith("dflash_"):
            cfg["dflash_config"][key.removeprefix("dflash_")] = value
        else:
            cfg[key] = value
    return cfg


REFUSED = [
    (_with(architectures=["DFlash2DraftModel"]), "architectures"),
    (_with(hidden_act="gelu_pytorch_tanh"), "hidden_act"),
    (_with(layer_types=["full_attention", "sliding_attention"], sliding_window=4), "layer 1"),
    (_with(layer_types=None, use_sliding_window=True, sliding_window=4, max_window_layers=0), "layer 0"),
    (_with(is_causal=True), "is_causal"),
    (_with(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (_with(dflash_final_logit_softcapping=20.0), "dflash_config.final_logit_softcapping"),
    (_with(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (_with(dflash_input_embedding_scale=2.0), "input_embedding_scale"),
    (_with(dflash_output_multiplier=0.196), "output_multiplier"),
    (_with(embedding_multiplier=12.0), "embedding_multiplier"),
    (_with(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (_with(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type"),
    (_with(dflash_conv_kernel_size=2), "dflash_config.conv_kernel_size"),
]
NEUTRAL = [
    _with(sliding_window=4096),  # Qwen3 writes a window even when use_sliding_window is false
    _with(layer_types=None, use_sliding_window=True, sliding_window=4, max_window_layers=28),
    _with(is_causal=False, final_logit_softcapping=None, dflash_input_embedding_scale=1.0,
          dflash_output_multiplier=1.0),
]


@pytest.mark.parametrize("config,field", REFUSED, ids=[f for _, f in REFUSED])
def test_a_field_that_changes_semantics_is_refused_by_name(tmp_path, config, field):
    ckpt = write_checkpoint(tmp_path / "drafter", config)
    with pytest.raises(UnsupportedDrafterConfig, match=re.escape(field)):
        DFlashDraftModel.load(ckpt)


@pytest.mark.parametrize("config", NEUTRAL)
def test_neutral_values_of_those_fields_load(tmp_path, config):
    assert DFlashDraftModel.load(write_checkpoint(tmp_path / "drafter", config)).config.block_size == BLOCK


def test_a_missing_mask_token_id_is_a_clear_error(tmp_path):
    cfg = _with()
    del cfg["dflash_config"]["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id is required"):
        DFlashDraftModel.load(write_checkpoint(tmp_path / "drafter", cfg))
    with pytest.raises(ValueError, match="mask_token_id = 99 outside the vocabulary"):
        DFlashDraftModel.load(write_checkpoint(tmp_path / "drafter", _with(dflash_mask_token_id=99)))


# -- --drafter as a hub id ---------------------------------------------------------------------
def test_drafter_hub_id_is_fetched_where_the_hub_answers(tmp_path, target, monkeypatch):
    import huggingface_hub

    served = write_checkpoint(tmp_path / "hub-snapshot", PUBLISHED)
    asked = []

    def snapshot_download(repo_id, **kwargs):  # the hub, answering
        asked.append((repo_id, kwargs.get("allow_patterns")))
        return str(served)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    spec = resolve_drafter("z-lab/Qwen3-8B-DFlash-b16", None)
    assert spec.path == served and asked[0][0] == "z-lab/Qwen3-8B-DFlash-b16"
    assert "config.json" in asked[0][1] and "*.safetensors" in asked[0][1]
    assert load_drafter_model(spec, target).config.mask_token_id == MASK


def test_drafter_hub_id_without_a_hub_says_so(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE (as here: no network) and an empty hub cache: a clear error, at once."""
    import huggingface_hub.constants as hub

    from presto_sd.embedded.stack import drafter_assets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(DrafterNotFoundError, match=r"--drafter z-lab/Qwen3-8B-DFlash-b16: not a local "
                       r"directory, and the hub is switched off here \(HF_HUB_OFFLINE\)"):
        drafter_assets(None, "z-lab/Qwen3-8B-DFlash-b16")  # what every command resolves --drafter with
    with pytest.raises(DrafterNotFoundError, match="no such directory"):
        resolve_drafter(str(tmp_path / "not-there"), None)
    # the command line says it in one line, before loading any model
    from presto_sd.app.cli import main

    with pytest.raises(SystemExit, match=r"^presto-sd: --drafter z-lab/Qwen3-8B-DFlash-b16: not a local"):
        main(["generate", "hi", "--drafter", "z-lab/Qwen3-8B-DFlash-b16", "--target", str(tmp_path / "t")])


# -- the torch floor -----------------------------------------------------------------------------
# torch APIs the code calls that older torch lacks: keyword -> the first torch that has it
TORCH_GATED = {"enable_gqa": (2, 5)}  # F.scaled_dot_product_attention(enable_gqa=...)


def test_the_torch_floor_is_what_the_code_calls():
    source = "\n".join(p.read_text() for pkg in ("presto_sd", "drafter_service", "verifier_service",
                                                 "orchestrator") for p in (ROOT / pkg).rglob("*.py"))
    needed = max((v for k, v in TORCH_GATED.items() if k in source), default=(0, 0))
    floor = re.search(r'"torch>=(\d+)\.(\d+)', (ROOT / "pyproject.toml").read_text())
    assert floor and (int(floor[1]), int(floor[2])) >= needed, (floor and floor[0], needed)
