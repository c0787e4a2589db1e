"""The owned decoder's forward through torch.compile (``models/compiled.py``): bitwise eager,
so every method stays greedy AR (and transformers' own ``generate`` in fp32); a compiled graph
that differs, or a compile that fails, leaves the decoder eager, never wrong."""

from __future__ import annotations

import logging

import pytest
import torch

from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.loop.generate import GenerationParams, generate
from presto_sd.method.builders import TreeParams
from presto_sd.models.compiled import CompiledForward
from presto_sd.models.packed import Segment, packed_plan
from tests.conftest import hf_greedy, make_engines, tiny_llama


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_is_bitwise_eager_and_every_method_greedy_ar(dtype):
    model = tiny_llama().to(dtype)
    verifier, drafter = make_engines(model)
    compiled = HFVerifier(model, verifier.target_layer_ids, name="tiny-llama", compile=True)
    graph = compiled.runner.owned.compiled
    assert graph is not None and verifier.runner.owned.compiled is None
    for method in ("ar", "presto-best-first"):
        params = GenerationParams(method=method, tree=TreeParams(budget=6, depth=4), max_new_tokens=24)
        prompt = [0, 3, 5, 7]
        expected = generate(verifier, drafter, prompt, params).token_ids
        assert generate(compiled, drafter, prompt, params).token_ids == expected
        if dtype == torch.float32:
            assert expected == hf_greedy(model, prompt, 24)
    # AR steps ran compiled, each shape checked bitwise on first use; trees ran eager
    assert graph.agreed and all(graph.agreed.values()) and graph.failed is None
    assert all(ar for _, _, groups in graph.agreed for ar, *_ in groups)


def _ar_call(v: HFVerifier, session: str):
    kv = v.sessions[session].kv
    plan = packed_plan([Segment(kv, 0, 1)], v.device, v.runner.attention_kernel)
    ids, positions = torch.tensor([4]), torch.tensor([kv.length])
    return v.runner.owned.forward(ids, positions, plan, v.target_layer_ids)


def _compiled_and_eager() -> tuple[HFVerifier, HFVerifier, CompiledForward]:
    """A compiled verifier and an eager one on the same tiny model, each with session "s"
    open; the compiled one's graph with no shape checked yet (the load's warm-up checked them)."""
    model = tiny_llama()
    v = HFVerifier(model, (0, 2), name="tiny", compile=True)
    eager = HFVerifier(model, (0, 2), name="tiny")
    v.prefill("s", [0, 3, 5]), eager.prefill("s", [0, 3, 5])
    graph = v.runner.owned.compiled
    graph.agreed.clear()
    return v, eager, graph


def test_a_compiled_graph_that_differs_is_dropped_for_eager(caplog):
    v, eager, graph = _compiled_and_eager()
    graph.graph = lambda *args: (lambda out, kept: (out + 1, kept))(*graph.forward(*args))  # a wrong graph
    with caplog.at_level(logging.WARNING):
        out, _ = _ar_call(v, "s")
    assert "differs from eager" in caplog.text and list(graph.agreed.values()) == [False]
    assert torch.equal(out, _ar_call(eager, "s")[0])  # eager's answer, not the graph's
    called = []
    graph.graph = lambda *args: called.append(1)
    _ar_call(v, "s")
    assert not called  # that shape runs eager from then on


def test_a_compile_that_fails_leaves_the_decoder_eager(caplog):
    v, eager, graph = _compiled_and_eager()

    def fail(*args):
        raise RuntimeError("no C++ compiler")

    graph.graph = fail
    with caplog.at_level(logging.WARNING):
        out, _ = _ar_call(v, "s")
    assert "torch.compile failed (RuntimeError: no C++ compiler)" in caplog.text
    assert torch.equal(out, _ar_call(eager, "s")[0])
    assert graph.failed and not graph.takes(torch.tensor([4]), packed_plan([], v.device))


def test_prompt_chunks_run_eager():
    model = tiny_llama()
    v = HFVerifier(model, (0, 2), name="tiny", compile=True)
    graph = v.runner.owned.compiled
    graph.agreed.clear()
    graph.graph = None  # any compiled call would fail loudly
    v.prefill("s", [0, 3, 5, 7, 2, 9])  # a prompt chunk: eager
    assert not graph.agreed
    assert isinstance(graph, CompiledForward)


def test_compile_needs_the_owned_decoder():
    with pytest.raises(ValueError, match="compile runs the owned decoder"):
        HFVerifier(tiny_llama(), (0, 2), decoder="transformers", compile=True)


def test_the_load_compiles_lone_and_batched_ar_steps():
    v = HFVerifier(tiny_llama(), (0, 2), name="tiny", compile=True)
    shapes = v.runner.owned.compiled.agreed
    assert all(shapes.values()) and not v.sessions  # its scratch sessions closed
    # one session's step with its keys inside its slot and filling it, on a page of one slot
    # and of several; two sessions' steps
    assert sorted((writes, groups[0][2:]) for _, writes, groups in shapes) == [
        ((1,), (False, False)), ((1,), (False, True)), ((1,), (True, False)), ((1,), (True, True)),
        ((2,), (False, False))]
    # after the load, a session's steps at every context length compile nothing new (no
    # recompile inside a timed run: what made the first compiled bench slower)
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    out = generate(v, None, [0, 3, 5], GenerationParams(method="ar", max_new_tokens=20))
    assert len(out.token_ids) == 20 and counters["stats"]["unique_graphs"] == before
