"""The generation batch's reserved KV cache computes what transformers' DynamicCache does."""

from __future__ import annotations

import pytest
import torch

import presto_sd.app.training.gen_data as gen_data
from tests.conftest import in_dtype, tiny_llama

PROMPTS = [[0, 3, 4, 5, 6, 7, 8], [0, 9], [0, 1, 2, 3], [0, 11, 12, 13, 14]]


def _generate(model, kv_cache: str, n: int = 24):
    cfg = gen_data.GenDataConfig(out="", max_new_tokens=n, target_layer_ids=(0, 2))
    # eos 3 and 13: rows end at different steps, so finished rows are dropped from the cache mid-batch
    return gen_data._generate_batch(model, PROMPTS, cfg, pad=0, eos={3, 13}, kv_cache=kv_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reserved_cache_equals_dynamic_cache(dtype, monkeypatch):
    model = in_dtype(tiny_llama(), dtype)
    made, reserved_cache = [], gen_data.ReservedCache  # a spy: which run reserved a cache
    monkeypatch.setattr(gen_data, "ReservedCache", lambda *a: made.append(a) or reserved_cache(*a))
    want, want_feats = _generate(model, "dynamic")
    assert made == []
    got, got_feats = _generate(model, "reserved")
    assert len(made) == 1
    assert got == want
    assert len({len(r) for r in got}) > 1, "the rows should end at different steps"
    for g, w in zip(got_feats, want_feats):
        assert torch.equal(g, w)


def test_a_reserved_cache_grows_past_its_reservation_as_a_dynamic_one_would():
    """Filled past its capacity (3 positions here), the layer regrows and goes on unchanged."""
    torch.manual_seed(0)
    reserved, dynamic = gen_data.ReservedCache(n_layers=1, capacity=3), gen_data.DynamicCache()
    rows = 2
    for step, n in enumerate((2, 1, 1, 3, 1)):
        k, v = torch.randn(rows, 1, n, 4), torch.randn(rows, 1, n, 4)
        got, want = reserved.update(k, v, 0), dynamic.update(k, v, 0)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), step
        if step == 2:  # a row ends: both keep row 1
            for cache in (reserved, dynamic):
                cache.batch_select_indices(torch.tensor([1]))
            rows = 1
    assert reserved.get_seq_length() == dynamic.get_seq_length() == 8


def test_reserved_cache_reports_its_filled_length():
    cache = gen_data.ReservedCache(n_layers=1, capacity=8)
    k = torch.randn(2, 1, 3, 4)
    keys, values = cache.update(k, k + 1, 0)
    assert cache.get_seq_length() == 3 and keys.shape[-2] == 3 and torch.equal(keys, k)
    cache.batch_select_indices(torch.tensor([1]))
    keys, _ = cache.update(k[1:, :, :1], k[1:, :, :1], 0)
    assert cache.get_seq_length() == 4 and torch.equal(keys[0, :, :3], k[1])
