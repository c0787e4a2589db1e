"""The peers: transformers' own ``generate`` on the same target model object, plain
(``hf-generate``: the decoding a user would otherwise call, in the same dtype) and with
prompt lookup (``hf-prompt-lookup``).

``model.generate(..., prompt_lookup_num_tokens=K)`` drafts up to ``K`` tokens by matching
the last n-gram against the context and verifies them in one forward: the speculative
decoder a CPU user can pick today with no drafter at all. Both are timed like the engine's
methods (wall time of the whole call, prefill included), and its rounds are read from
outside without touching transformers' loop:

- a forward hook on the model times every target forward and counts its input tokens
  (a round verifies ``inputs - 1`` drafted tokens: the tree size of a chain);
- a streamer sees the tokens each round commits (accepted + 1).

The first forward is the prefill (prompt + its first drafts); like the engine's prefill
it is not a round. Drafting (the n-gram match) and bookkeeping land in ``other``.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig

from presto_sd.app.bench.methods import BenchContext, register_method
from presto_sd.loop.generate import GenerationParams, GenerationResult, RoundStats


class _RoundStreamer:
    """Collects what ``generate`` commits: the prompt first, then one chunk per forward."""

    def __init__(self) -> None:
        self.chunks: list[int] = []
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(int(value.numel()))
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class _ForwardTimer:
    """Times each forward of ``model`` and records its input length."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.sizes: list[int] = []
        self.seconds: list[float] = []
        self._t0 = 0.0
        self._sync = model.device.type == "cuda"

    def _pre(self, module, args, kwargs) -> None:
        if self._sync:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.sizes.append(int(ids.shape[-1]) if ids is not None else 0)

    def _post(self, module, args, kwargs, output) -> None:
        if self._sync:
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._t0)

    def __enter__(self) -> _ForwardTimer:
        self._hooks = [
            self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.model.register_forward_hook(self._post, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()


def _generation_config(ctx: BenchContext, params: GenerationParams, lookup: bool) -> GenerationConfig:
    s = params.sampling
    eos = list(params.stop_token_ids) or None
    sample = s.temperature > 0
    return GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        prompt_lookup_num_tokens=ctx.lookup_tokens if lookup else None,
        do_sample=sample,
        temperature=s.temperature if sample else None,
        top_p=s.top_p if sample and s.top_p < 1.0 else None,
        top_k=s.top_k if sample and s.top_k > 0 else None,
        eos_token_id=eos,
        pad_token_id=eos[0] if eos else 0,
    )


def _describe(ctx: BenchContext, params: GenerationParams) -> dict:
    return {"prompt_lookup_num_tokens": ctx.lookup_tokens}


@register_method("hf-prompt-lookup", budgeted=False, describe=_describe)
def run_hf_prompt_lookup(
    ctx: BenchContext, prompt_ids: list[int], params: GenerationParams
) -> GenerationResult:
    return _run_hf(ctx, prompt_ids, params, lookup=True)


@register_method("hf-generate", budgeted=False, describe=lambda ctx, params: {})
def run_hf_generate(ctx: BenchContext, prompt_ids: list[int], params: GenerationParams) -> GenerationResult:
    return _run_hf(ctx, prompt_ids, params, lookup=False)


def _run_hf(ctx: BenchContext, prompt_ids: list[int], params: GenerationParams,
            lookup: bool) -> GenerationResult:
    model = getattr(ctx.verifier, "model", None)
    if model is None:
        raise ValueError("the hf-* peers need an in-process transformers target (HFVerifier)")
    config = _generation_config(ctx, params, lookup)
    ids = torch.tensor([prompt_ids], device=model.device)
    streamer = _RoundStreamer()
    if params.sampling.temperature > 0 and params.sampling.seed is not None:
        torch.manual_seed(params.sampling.seed)
    t0 = time.perf_counter()
    with _ForwardTimer(model) as timer, torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             streamer=streamer)
    total = time.perf_counter() - t0
    tokens = out[0, len(prompt_ids):].tolist()
    committed = streamer.chunks[1:]  # chunk 0 is the prompt
    prefill_s = (streamer.times[1] - t0) if len(streamer.times) > 1 else total
    rounds = [
        RoundStats(accepted=n - 1, tree_size=size - 1, draft_s=0.0, build_s=0.0, verify_s=sec, commit_s=0.0)
        for n, size, sec in zip(committed[1:], timer.sizes[1:], timer.seconds[1:])
    ]
    finish = "eos" if tokens and tokens[-1] in params.stop_token_ids else "length"
    return GenerationResult(tokens, rounds, finish, prefill_s, total - prefill_s)
