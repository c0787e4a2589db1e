"""The owned decoder forward (``models/llama.py``): bitwise the transformers path it replaces,
on Llama, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms) configs, and lossless."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.loop.generate import GenerationParams, generate
from presto_sd.method.builders import TreeParams
from presto_sd.method.tree import TokenTree
from presto_sd.models import llama
from presto_sd.models.invariant import ATTENTION_KERNELS
from presto_sd.models.packed import Segment
from tests.conftest import hf_greedy, make_engines

PROMPT = [0, 3, 5, 7, 2, 9, 4, 1, 8]
TREE = ([1, 6, 11, 8, 12, 3], [-1, 0, 0, 0, 2, 3, 5])  # tokens after the anchor, parents
SHAPE = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


def tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, bos_token_id=0, eos_token_id=None, pad_token_id=None))
    elif kind == "qwen2":  # q/k/v projections with biases
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, bos_token_id=0, eos_token_id=None, pad_token_id=None))
    else:  # qwen3: head_dim apart from hidden/heads, RMSNorm on each q/k head
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16, bos_token_id=0, eos_token_id=None,
                                             pad_token_id=None))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # greedy far from ties
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # non-trivial biases and norm weights
                p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def packed_call(v: HFVerifier) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward packing a tree of one session and a prompt chunk of another."""
    pre = v.prefill("tree", PROMPT)
    v.prefill("chunk", PROMPT[:4])
    tree = TokenTree.from_lists([pre.anchor, *TREE[0]], TREE[1])
    tree_kv, chunk_kv = v.sessions["tree"].kv, v.sessions["chunk"].kv
    n = len(tree.tokens)
    segments = [Segment(tree_kv, 0, n, tree.paths()), Segment(chunk_kv, n, 3)]
    positions = [*tree.position_ids(len(PROMPT)), *range(chunk_kv.length, chunk_kv.length + 3)]
    with torch.inference_mode():
        return v.runner.forward(segments, [*tree.tokens, 5, 6, 7], positions)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_owned_forward_is_bitwise_the_transformers_path(kind, dtype):
    model = tiny(kind).to(dtype)
    owned = HFVerifier(model, (0, 2), decoder="owned")
    reference = HFVerifier(model, (0, 2), decoder="transformers")
    assert owned.runner.owned is not None and reference.runner.owned is None
    assert (owned.info().decoder, reference.info().decoder) == ("owned", "transformers")
    assert owned.info().weights == "dense" and owned.info().attention_kernel in ATTENTION_KERNELS
    (h1, f1), (h2, f2) = packed_call(owned), packed_call(reference)
    assert torch.equal(h1, h2) and torch.equal(f1, f2)
    for layer in range(model.config.num_hidden_layers):  # and the KV both wrote
        for name in ("tree", "chunk"):
            a, b = owned.sessions[name].kv, reference.sessions[name].kv
            n = a.length + (10 if name == "tree" else 3)
            assert torch.equal(a.page.keys[layer][a.slot, :, :n], b.page.keys[layer][b.slot, :, :n])


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_the_owned_forward_equals_transformers_own_forward(kind):
    """fp32 logits of every tree node against transformers' plain forward of its path."""
    model = tiny(kind)
    v = HFVerifier(model, (0, 2), decoder="owned")
    pre = v.prefill("s", PROMPT)
    tree = TokenTree.from_lists([pre.anchor, *TREE[0]], TREE[1])
    seg = Segment(v.sessions["s"].kv, 0, len(tree.tokens), tree.paths())
    with torch.inference_mode():
        hidden, _ = v.runner.forward([seg], list(tree.tokens), tree.position_ids(len(PROMPT)))
        logits = v.runner.logits(hidden)
        for node in range(len(tree.tokens)):
            ref = model(torch.tensor([PROMPT + tree.path_tokens(node)])).logits[0, -1]
            torch.testing.assert_close(logits[node], ref, atol=1e-4, rtol=0)  # same math, other shapes


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("method", ["linear", "marginal", "presto-best-first", "taps"])
def test_every_method_is_greedy_ar_on_the_other_families(kind, method):
    """(Llama: tests/test_lossless.py runs the owned decoder, the default for it.)"""
    model = tiny(kind)
    verifier, drafter = make_engines(model)
    assert verifier.runner.owned is not None
    params = GenerationParams(method=method, tree=TreeParams(budget=16, depth=6),
                              max_new_tokens=20)
    for prompt in ([0, 3, 5, 7], [0, 9]):
        assert generate(verifier, drafter, prompt, params).token_ids == hf_greedy(model, prompt, 20)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_qkv_and_gate_up_run_as_one_matmul_each(kind):
    """Fused where the probe agrees (vLLM's QKVParallelLinear): the output is the separate
    linears' side by side, bitwise, at 1 and many rows, and the modules' weights (biases too)
    become views of the stacked tensor, not a second copy."""
    model = tiny(kind)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    modules = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
    separate = [llama._Linear.of(m) for m in modules]
    weights = [f.weight.clone() for f in separate]
    layer = llama.LlamaDecoder(model).layers[1]
    assert isinstance(layer.qkv, llama._Linear) and isinstance(layer.gate_up, llama._Linear)
    assert attn.k_proj.weight.data_ptr() == layer.qkv.weight[attn.q_proj.out_features :].data_ptr()
    assert all(torch.equal(w, f.weight) for w, f in zip(weights, separate))  # the same values
    if kind == "qwen2":
        assert attn.v_proj.bias.data_ptr() == layer.qkv.bias[-attn.v_proj.out_features :].data_ptr()
    for rows in (1, 5):
        x = torch.randn(rows, SHAPE["hidden_size"])
        assert torch.equal(layer.qkv(x), torch.cat([f(x) for f in separate[:3]], -1))
        assert torch.equal(layer.gate_up(x), torch.cat([f(x) for f in separate[3:]], -1))


def test_linears_that_do_not_fuse_run_one_by_one(monkeypatch):
    """Where the probe disagrees, the parts run one by one: same output, nothing re-pointed."""
    monkeypatch.setattr(llama, "fusion_kernel_agrees", lambda *a: False)
    model = tiny("llama")
    attn = model.model.layers[0].self_attn
    ptr = attn.k_proj.weight.data_ptr()
    layer = llama.LlamaDecoder(model).layers[0]
    assert isinstance(layer.qkv, llama._Stacked) and attn.k_proj.weight.data_ptr() == ptr
    x = torch.randn(2, SHAPE["hidden_size"])
    assert torch.equal(layer.qkv(x), torch.cat([llama._Linear.of(m)(x) for m in (attn.q_proj, attn.k_proj,
                                                                                 attn.v_proj)], -1))


def test_models_outside_the_family_keep_the_transformers_path():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    assert not llama.supports(gpt2)
    with pytest.raises(ValueError, match="not a Llama-family model"):
        llama.LlamaDecoder(gpt2)
    llama_model = tiny("llama")
    assert llama.supports(llama_model)
    with pytest.raises(ValueError, match="decoder 'fast'"):
        HFVerifier(llama_model, (0, 2), decoder="fast")


@pytest.mark.smollm2
def test_the_owned_forward_is_bitwise_the_transformers_path_on_smollm2(smollm2_dir):
    from presto_sd.models.loading import load_target

    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_target(str(smollm2_dir), torch.device("cpu"), dtype)
        owned = HFVerifier(model, (1, 8, 14, 20, 27), decoder="owned")
        reference = HFVerifier(model, (1, 8, 14, 20, 27), decoder="transformers")
        (h1, f1), (h2, f2) = packed_call(owned), packed_call(reference)
        assert torch.equal(h1, h2) and torch.equal(f1, f2), dtype
