"""The GGUF's own Q4_1 weights through torch's int4 CPU kernel (``presto_sd.models.quant``)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from presto_sd.embedded.dflash_drafter import DFlashDrafter
from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.loop.generate import GenerationParams, generate
from presto_sd.method.builders import TreeParams
from presto_sd.models.quant import (
    GROUP,
    Int4Linear,
    Q4Blocks,
    Q8Head,
    QuantError,
    _reverse_permute,
    gguf_q8_0_head,
    int4_linears,
    q8_0_blocks,
)
from tests.conftest import tiny_drafter_model, tiny_llama

METHODS = ("linear", "marginal", "presto-beam", "presto-best-first", "taps")


def test_blocks_read_from_gguf_bytes_are_ggufs_own_dequantization():
    w = np.random.default_rng(0).standard_normal((16, 4 * GROUP)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    ours = Q4Blocks.from_gguf(raw, 16, 4 * GROUP).dequantize()
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).reshape(16, 4 * GROUP)
    assert torch.equal(ours, torch.from_numpy(theirs))


def test_quantize_is_llama_cpps_q4_1():
    w = np.random.default_rng(1).standard_normal((8, 2 * GROUP)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).reshape(8, -1))
    ours = Q4Blocks.quantize(torch.from_numpy(w)).dequantize()
    # llama.cpp rounds q its own way (x * (1/d) + 0.5): a weight may land one step apart
    step = (ours - theirs).abs().max()
    assert step <= Q4Blocks.quantize(torch.from_numpy(w)).d.max() * 1.01


def test_q_and_k_rows_are_reordered_as_transformers_loader_does():
    heads, n, k = 4, 32, GROUP
    blocks = Q4Blocks.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(2)))
    theirs = LlamaTensorProcessor()._reverse_permute_weights(blocks.dequantize().numpy(), heads, heads)
    assert torch.equal(_reverse_permute(blocks, heads).dequantize(), torch.from_numpy(theirs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_multiplies_by_the_blocks(dtype):
    g = torch.Generator().manual_seed(3)
    blocks = Q4Blocks.quantize(torch.randn(64, 3 * GROUP, generator=g))
    lin = Int4Linear(blocks, dtype)
    x = torch.randn(5, 3 * GROUP, generator=g).to(dtype)
    ref = x.float() @ blocks.dequantize().t()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(lin(x).float(), ref, atol=tol, rtol=tol)
    if dtype == torch.float32:  # fp32 scales: the kernel's weights are the dequantized ones, exactly
        eye = torch.eye(3 * GROUP)
        assert torch.equal(lin(eye).t(), blocks.dequantize())
    assert lin(x[None, :3]).shape == (1, 3, 64)  # leading dims kept
    assert lin.rows_agree()


def _quantized_tiny(dtype: torch.dtype):
    """A tiny Llama whose linears hold Q4_1 values (as a GGUF-loaded model does), and their blocks."""
    model = tiny_llama(vocab=64).to(dtype)
    blocks = {}
    for name, m in model.get_decoder().named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("layers."):
            blocks[name] = Q4Blocks.quantize(m.weight.float())
            with torch.no_grad():
                m.weight.copy_(blocks[name].dequantize().to(dtype))
    return model, blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_method_is_bitwise_the_int4_modes_own_ar(dtype):
    model, blocks = _quantized_tiny(dtype)
    draft_model = tiny_drafter_model(model).to(dtype)
    linears = int4_linears(blocks, model, dtype)
    verifier = HFVerifier(model, draft_model.config.target_layer_ids, linears=linears)
    assert verifier.runner.row_invariant and verifier.runner.owned is not None
    drafter = DFlashDrafter(draft_model, model.get_input_embeddings().weight.detach(),
                            model.get_output_embeddings().weight.detach())
    prompt = [1, 5, 9, 13]
    ar = generate(verifier, None, prompt, GenerationParams(method="ar", max_new_tokens=24)).token_ids
    for method in METHODS:
        tree = TreeParams(budget=8, depth=4)
        params = GenerationParams(method=method, tree=tree, max_new_tokens=24)
        assert generate(verifier, drafter, prompt, params).token_ids == ar, method


def test_the_int4_mode_computes_with_the_blocks_not_the_dense_weights():
    model, blocks = _quantized_tiny(torch.float32)
    linears = int4_linears(blocks, model, torch.float32)
    int4 = HFVerifier(model, (0, 1), linears=linears)
    layer = int4.runner.owned.layers[0]
    assert layer.down is linears["layers.0.mlp.down_proj"]
    # gate and up run as one int4 matmul over their stacked blocks: bitwise theirs side by side
    x = torch.randn(3, model.config.hidden_size)
    gate, up = linears["layers.0.mlp.gate_proj"], linears["layers.0.mlp.up_proj"]
    assert torch.equal(layer.gate_up(x), torch.cat([gate(x), up(x)], -1))


def test_blocks_that_are_not_the_loaded_weights_are_refused():
    model, blocks = _quantized_tiny(torch.float32)
    other = dict(blocks)
    name = "layers.1.self_attn.o_proj"
    other[name] = Q4Blocks.quantize(torch.randn_like(blocks[name].dequantize()))
    with pytest.raises(QuantError, match="not the loaded weight"):
        int4_linears(other, model, torch.float32)
    del other[name]
    with pytest.raises(QuantError, match="do not cover"):
        int4_linears(other, model, torch.float32)


def test_linears_need_the_owned_decoder():
    model, blocks = _quantized_tiny(torch.float32)
    with pytest.raises(ValueError, match="owned decoder"):
        HFVerifier(model, (0, 1), decoder="transformers", linears=int4_linears(blocks, model, torch.float32))


@pytest.mark.smollm2
def test_smollm2_gguf_int4_every_method_is_bitwise_its_ar(smollm2_dir):
    from presto_sd.embedded.stack import build_embedded

    built = build_embedded(weights="gguf-int4", device=torch.device("cpu"))
    assert built.verifier.runner.row_invariant
    # the GGUF's Q8_0 head
    assert isinstance(built.verifier.runner.head, Q8Head) and built.verifier.walk_rows == 4
    assert built.verifier.info().weights == "gguf-int4"
    prompt = built.tokenizer.encode("Write a Python function that adds two numbers.")
    ar = generate(built.verifier, None, prompt, GenerationParams(method="ar", max_new_tokens=32)).token_ids
    for method in ("linear", "presto-best-first", "taps"):
        tree = TreeParams(budget=8, depth=7)
        params = GenerationParams(method=method, tree=tree, max_new_tokens=32)
        assert generate(built.verifier, built.drafter, prompt, params).token_ids == ar, method


def _q8_0(n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    return (raw, *q8_0_blocks(raw, n, k))


def test_q8_0_blocks_are_ggufs_own_dequantization():
    raw, q, d = _q8_0(16, 4 * GROUP, 4)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(16, -1)
    assert q.min() >= -128 and q.max() <= 127
    assert torch.equal((q.float().view(16, 4, GROUP) * d[..., None]).view(16, -1), torch.from_numpy(theirs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_q8_head_is_two_int4_planes_that_sum_to_the_blocks(dtype):
    """q + 128 = 16 hi + lo: the planes' weights sum to d q exactly (fp32 scales show it
    through an identity), and the logits are the product within the activations' rounding."""
    _, q, d = _q8_0(64, 3 * GROUP, 5)
    head = Q8Head(q, d, dtype)
    dense = (q.float().view(64, 3, GROUP) * d[..., None]).view(64, -1)
    if dtype == torch.float32:
        assert torch.equal(head(torch.eye(3 * GROUP)).t(), dense)
    x = torch.randn(5, 3 * GROUP, generator=torch.Generator().manual_seed(6)).to(dtype)
    out = head(x)
    assert out.dtype == torch.float32 and out.shape == (5, 64)
    tol = 1e-4 if dtype == torch.float32 else 0.15
    assert torch.allclose(out, x.float() @ dense.t(), atol=tol, rtol=tol)
    assert head.rows_agree()


def _gguf_with_head(tmp_path, model, dtype: torch.dtype, kind=gguf.GGMLQuantizationType.Q8_0):
    """A GGUF holding the model's head as ``output.weight`` (Q8_0), the model's head set to it."""
    w = model.lm_head.weight.detach().float().numpy()
    raw = gguf.quants.quantize(w, kind)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.from_numpy(
            gguf.quants.dequantize(raw, kind).reshape(w.shape)).to(dtype))
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    writer.add_tensor("output.weight", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / "tiny.gguf"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_method_is_bitwise_the_int4_modes_own_ar_with_the_q8_head(tmp_path, dtype):
    model, blocks = _quantized_tiny(dtype)
    head = gguf_q8_0_head(_gguf_with_head(tmp_path, model, dtype), model, dtype)
    assert head is not None
    draft_model = tiny_drafter_model(model).to(dtype)
    linears = int4_linears(blocks, model, dtype)
    verifier = HFVerifier(model, draft_model.config.target_layer_ids, linears=linears, head=head, walk_rows=4)
    assert verifier.runner.row_invariant
    drafter = DFlashDrafter(draft_model, model.get_input_embeddings().weight.detach(),
                            model.get_output_embeddings().weight.detach())
    prompt = [1, 5, 9, 13]
    ar = generate(verifier, None, prompt, GenerationParams(method="ar", max_new_tokens=24)).token_ids
    for method in METHODS:
        params = GenerationParams(method=method, tree=TreeParams(budget=8, depth=4), max_new_tokens=24)
        assert generate(verifier, drafter, prompt, params).token_ids == ar, method


def test_a_q8_head_that_is_not_the_loaded_one_is_refused(tmp_path):
    model, _ = _quantized_tiny(torch.float32)
    path = _gguf_with_head(tmp_path, model, torch.float32)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with pytest.raises(QuantError, match="not the loaded lm_head"):
        gguf_q8_0_head(path, model, torch.float32)


def test_a_head_of_another_type_keeps_the_dense_head(tmp_path):
    model, _ = _quantized_tiny(torch.float32)
    path = _gguf_with_head(tmp_path, model, torch.float32, gguf.GGMLQuantizationType.F32)
    assert gguf_q8_0_head(path, model, torch.float32) is None
