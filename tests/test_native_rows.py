"""The decode rows' C kernel (``native_rows.py``): what it computes, how the verifier reads the
page with it in place, and that without it the verifier keeps torch's SDPA.

Its row invariance is held with every other kernel's in ``test_invariance.py`` (the probe
and the trees' rows against the AR steps run it wherever it is built and picked)."""

from __future__ import annotations

import pytest
import torch

from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.method.tree import TokenTree
from presto_sd.models import invariant, native_rows, packed
from presto_sd.models.invariant import pick_attention_kernel, row_attention
from tests.conftest import in_dtype
from tests.test_invariance import PROMPT

needs_native = pytest.mark.skipif(not native_rows.available(), reason="no C compiler built the kernel here")


def eager_reference(q, k, v, seen, scaling):
    """fp64 attention of q [A, B, G, D] over the first seen[a, b] keys of k/v [A, B, W, D]."""
    scores = torch.einsum("abgd,abwd->abgw", q.double(), k.double()) * scaling
    hidden = torch.arange(k.shape[2])[None, None] >= seen[..., None]
    weights = scores.masked_fill(hidden[:, :, None], float("-inf")).softmax(-1)
    return torch.einsum("abgw,abwd->abgd", weights, v.double())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (2, 8), (1, 24), (16, 256)])
def test_it_computes_attention(dtype, group, head_dim):
    """Within a rounding of the reference, for head dims that are and are not a multiple of
    its 16 lanes, one to 16 query heads a KV head, keys seen from 1 to all 300."""
    g = torch.Generator().manual_seed(head_dim)
    a, b, width = 4, 3, 300
    q, k, v = (torch.randn(a, b, n, head_dim, generator=g).to(dtype) for n in (group, width, width))
    seen = torch.randint(1, width + 1, (a, b), generator=g)
    seen[0, 0], seen[-1, -1] = 1, width
    visible = torch.arange(width)[None, None] < seen[..., None]
    got = row_attention(q, k, v, visible, head_dim**-0.5, "native")
    want = eager_reference(q, k, v, seen, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def tree_units(rows: int, kv_heads: int, prefix: int, head_dim: int, group: int, dtype, seed: int):
    """A tree's rows over a committed prefix as ``packed._NativeUnits`` lays them out: every
    row's keys the prefix, then 1-5 keys of its own; its units row-major (row, KV head)."""
    g = torch.Generator().manual_seed(seed)
    capacity = prefix + 24
    keys, values = (torch.randn(1, kv_heads, capacity, head_dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(rows * kv_heads, group, head_dim, generator=g).to(dtype)
    depth = torch.randint(1, 6, (rows,), generator=g)
    pos = torch.zeros(rows, prefix + 8, dtype=torch.long)
    for r in range(rows):
        pos[r, :prefix] = torch.arange(prefix)
        pos[r, prefix : prefix + int(depth[r])] = prefix + torch.randperm(24, generator=g)[: int(depth[r])]
    kv_offset = (torch.arange(kv_heads) * capacity * head_dim).repeat(rows)
    pos_row = torch.arange(rows).repeat_interleave(kv_heads)
    return q, keys, values, kv_offset, pos, pos_row, (prefix + depth).repeat_interleave(kv_heads)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (2, 24), (4, 128)])
def test_a_trees_rows_read_together_are_bitwise_each_row_alone(dtype, group, head_dim):
    """A tree's rows over one KV head given as a run (the prefix's keys and values loaded once
    for them all) compute each row as it is computed alone, bit for bit: prefixes on either
    side of the 16-key blocks and of the value pairs, and none at all."""
    for prefix in (0, 1, 15, 16, 17, 150):
        *units, seen = tree_units(5, 2, prefix, head_dim, group, dtype, seed=prefix)
        alone = native_rows.unit_attention(*units, seen, head_dim**-0.5)
        runs = native_rows.SharedRuns.by_kv_head(5, 2, prefix)
        assert torch.equal(native_rows.unit_attention(*units, seen, head_dim**-0.5, runs), alone), prefix


@needs_native
def test_runs_that_do_not_share_what_they_say_are_refused():
    """The C side trusts a run: units of another KV head, a prefix the rows do not hold, one
    past a row's keys, or a unit left out are refused before the call."""
    *units, seen = tree_units(4, 2, 40, 64, 3, torch.bfloat16, seed=0)

    def call(runs: native_rows.SharedRuns) -> torch.Tensor:
        return native_rows.unit_attention(*units, seen, 0.125, runs)

    good = native_rows.SharedRuns.by_kv_head(4, 2, 40)
    call(good)
    with pytest.raises(ValueError, match="do not share"):  # row-major units taken as head-major runs
        call(native_rows.SharedRuns(torch.arange(8), good.start, good.shared))
    with pytest.raises(ValueError, match="do not share"):  # the rows part after the prefix
        call(native_rows.SharedRuns(good.order, good.start, torch.tensor([42, 42])))
    with pytest.raises(ValueError, match="do not share"):  # past a row's keys
        call(native_rows.SharedRuns(good.order, good.start, torch.tensor([int(seen.min()) + 1] * 2)))
    with pytest.raises(ValueError, match="every unit once"):
        call(native_rows.SharedRuns(good.order[:-1], torch.tensor([0, 4, 7]), good.shared))
    with pytest.raises(ValueError, match="non-empty"):
        call(native_rows.SharedRuns(good.order, torch.tensor([0, 0, 8]), good.shared))


@needs_native
def test_it_refuses_what_it_cannot_read():
    """Shapes past its fixed buffers, mixed dtypes, non-contiguous or non-int64 inputs, and a
    mask that is not a prefix: a clear error, nothing computed."""
    q = torch.randn(2, 17, 64)  # 17 query heads a KV head: past MAX_GROUP
    keys = torch.randn(2, 10, 64)
    runs, first_row = torch.tensor([0, 640]), torch.zeros(2, dtype=torch.long)
    args = (runs, torch.arange(10)[None], first_row, torch.tensor([10, 10]))
    with pytest.raises(ValueError, match="must be <= 16"):
        native_rows.unit_attention(q, keys, keys, *args, 0.125)
    q = torch.randn(2, 3, 64)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        native_rows.unit_attention(q, keys.bfloat16(), keys.bfloat16(), *args, 0.125)
    with pytest.raises(ValueError, match="contiguous"):
        native_rows.unit_attention(q, keys.transpose(0, 1), keys, *args, 0.125)
    with pytest.raises(ValueError, match="int64"):
        native_rows.unit_attention(q, keys, keys, args[0].int(), *args[1:], 0.125)
    with pytest.raises(ValueError, match="outside"):  # a key past the run
        native_rows.unit_attention(q, keys, keys, runs, torch.arange(11)[None], first_row,
                                   torch.tensor([11, 11]), 0.125)
    with pytest.raises(ValueError, match="outside"):  # seen past the width
        native_rows.unit_attention(q, keys, keys, runs, torch.arange(10)[None], first_row,
                                   torch.tensor([10, 12]), 0.125)
    with pytest.raises(ValueError, match="a unit"):  # one seen short
        native_rows.unit_attention(q, keys, keys, runs, torch.arange(10)[None], first_row, torch.tensor([10]),
                                   0.125)
    scattered = torch.tensor([[True, False, True]])
    with pytest.raises(ValueError, match="prefix"):
        row_attention(torch.randn(1, 1, 3, 64), torch.randn(1, 1, 3, 64), torch.randn(1, 1, 3, 64),
                      scattered, 0.125, "native")


@needs_native
def test_the_verifier_reads_the_page_in_place_as_the_gathered_keys(tiny_target, monkeypatch):
    """A verify of a branching tree, then AR steps, through the in-place path (the plan's
    ``_NativeUnits``) gives what the same kernel gives over keys gathered as the other
    kernels take them (``row_attention``): bitwise, bf16, every node's probabilities."""
    model = in_dtype(tiny_target, torch.bfloat16)

    def run() -> list:
        v = HFVerifier(model, (0, 2))
        v.runner.attention_kernel = "native"
        pre = v.prefill("s", PROMPT)
        res = v.verify("s", pre.base, TokenTree.from_lists([pre.anchor, 3, 5, 7, 1], [-1, 0, 0, 1, 3]),
                       want_node_probs=True)
        seen = [res.node_probs]
        for _ in range(3):
            res = v.verify("s", res.base, TokenTree.root_only(res.bonus), want_node_probs=True)
            seen.append(res.node_probs)
        return seen

    in_place = run()
    with monkeypatch.context() as m:  # the plan without its in-place view: row_attention's way
        m.setattr(packed._NativeUnits, "of", classmethod(lambda cls, *a: None))
        gathered = run()
    assert all(torch.equal(a, b) for a, b in zip(in_place, gathered, strict=True))


def test_without_a_compiler_the_verifier_keeps_sdpa(monkeypatch, tmp_path):
    """No C compiler (``CC`` names none) and an empty kernel cache, a kernel cache that
    cannot be written (a container's read-only root), or the switch ``PRESTO_SD_NATIVE_ROWS=0``:
    the kernel is not available and bf16 picks torch's SDPA (or the eager ops) as before;
    nothing fails."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PRESTO_SD_KERNELS", str(tmp_path / "kernels"))
    native_rows._library.cache_clear()
    pick_attention_kernel.cache_clear()
    try:
        assert not native_rows.available()
        assert pick_attention_kernel(3, 3, 64, torch.bfloat16) in ("sdpa", "eager")
    finally:
        native_rows._library.cache_clear()
        pick_attention_kernel.cache_clear()
    monkeypatch.delenv("CC")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for env, path in (("PRESTO_SD_KERNELS", blocker / "kernels"), ("PRESTO_SD_CACHE", blocker)):
        monkeypatch.delenv("PRESTO_SD_KERNELS", raising=False)
        monkeypatch.setenv(env, str(path))  # a cache that cannot be written (a read-only root)
        native_rows._library.cache_clear()
        pick_attention_kernel.cache_clear()
        try:
            assert not native_rows.available(), env
            assert pick_attention_kernel(3, 3, 64, torch.bfloat16) in ("sdpa", "eager")
        finally:
            native_rows._library.cache_clear()
            pick_attention_kernel.cache_clear()
    monkeypatch.delenv("PRESTO_SD_KERNELS", raising=False)
    monkeypatch.delenv("PRESTO_SD_CACHE", raising=False)
    monkeypatch.setenv(native_rows.DISABLE_ENV, "0")
    try:
        assert not native_rows.available()
        assert pick_attention_kernel(3, 3, 64, torch.bfloat16) in ("sdpa", "eager")
    finally:
        pick_attention_kernel.cache_clear()


@needs_native
def test_fp32_keeps_torchs_kernel():
    """fp32's AR equals transformers' own ``generate``, whose attention rounds as torch's
    SDPA does: the C kernel (its own exp) is never picked there."""
    assert invariant.pick_attention_kernel(3, 3, 64, torch.float32) != "native"


def test_a_replay_records_anew_for_another_attention_kernel(tmp_path, monkeypatch):
    """The replay's recordings are the engine's own AR outputs: an engine whose attention
    rounds otherwise (another kernel) must not reuse them, or the replay's tau would not be
    the live bench's."""
    import argparse
    from dataclasses import replace

    from presto_sd.app.bench.replay_cli import _recordings_path
    from presto_sd.app.bench.runner import BenchPrompt
    from presto_sd.engine.verifier import VerifierInfo

    monkeypatch.setenv("PRESTO_SD_CACHE", str(tmp_path))
    args = argparse.Namespace(recordings=None, max_new_tokens=16)
    info = VerifierInfo(model="m", dtype="bfloat16", device="cpu", vocab_size=16, eos_token_ids=(),
                        target_layer_ids=(0, 2), attention_kernel="native")
    prompts = [BenchPrompt("gsm8k", "0", (1, 2, 3))]
    path = _recordings_path(args, info, prompts)
    assert path == _recordings_path(args, info, prompts)
    assert path != _recordings_path(args, replace(info, attention_kernel="sdpa"), prompts)


@needs_native
def test_a_row_that_sees_no_key_gets_zeros():
    """Never asked by the verifier (a row sees at least itself), but defined: zeros, not NaN."""
    q, keys = torch.randn(2, 3, 64).bfloat16(), torch.randn(2, 4, 64).bfloat16()
    out = native_rows.unit_attention(q, keys, keys, torch.tensor([0, 256]), torch.arange(4)[None],
                                     torch.zeros(2, dtype=torch.long), torch.tensor([0, 4]), 0.125)
    assert torch.equal(out[0], torch.zeros(3, 64, dtype=torch.bfloat16)) and bool(out[1].isfinite().all())
