"""The generation batch's reserved KV cache computes what transformers' DynamicCache does."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import presto_sd.app.training.gen_data as gen_data
from tests.conftest import in_dtype, tiny_llama

RESERVED = gen_data.ReservedCache  # before any test patches the module
PROMPTS = [[0, 3, 4, 5, 6, 7, 8], [0, 9], [0, 1, 2, 3], [0, 11, 12, 13, 14]]


def _generate(model, monkeypatch, cache_factory, n: int = 24):
    monkeypatch.setattr(gen_data, "ReservedCache", cache_factory)
    cfg = gen_data.GenDataConfig(out="", max_new_tokens=n, target_layer_ids=(0, 2))
    # eos 3 and 13: rows end at different steps, so finished rows are dropped from the cache mid-batch
    return gen_data._generate_batch(model, PROMPTS, cfg, pad=0, eos={3, 13})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity", [None, 3])  # None: reserved for the whole batch; 3: grows
def test_reserved_cache_equals_dynamic_cache(monkeypatch, dtype, capacity):
    model = in_dtype(tiny_llama(), dtype)
    want, want_feats = _generate(model, monkeypatch, lambda n_layers, cap: DynamicCache())
    got, got_feats = _generate(model, monkeypatch,
                               lambda n_layers, cap: RESERVED(n_layers, capacity or cap))
    assert got == want
    assert len({len(r) for r in got}) > 1, "the rows should end at different steps"
    for g, w in zip(got_feats, want_feats):
        assert torch.equal(g, w)


def test_reserved_cache_reports_its_filled_length():
    cache = RESERVED(n_layers=1, capacity=8)
    k = torch.randn(2, 1, 3, 4)
    keys, values = cache.update(k, k + 1, 0)
    assert cache.get_seq_length() == 3 and keys.shape[-2] == 3 and torch.equal(keys, k)
    cache.batch_select_indices(torch.tensor([1]))
    keys, _ = cache.update(k[1:, :, :1], k[1:, :, :1], 0)
    assert cache.get_seq_length() == 4 and torch.equal(keys[0, :, :3], k[1])
