"""The llama.cpp peer (``llama-cpp``): the same GGUF file, decoded by llama.cpp itself.

A person who runs a small model on a CPU today picks llama.cpp, so the bench puts its
tokens/s beside presto-sd's, on the target's own GGUF (the default SmolLM2 target *is* a
Q4_1 GGUF; presto-sd dequantizes it or, with ``--weights gguf-int4``, runs its 4-bit
blocks). llama-cpp-python is an optional extra built from its sdist
(``pip install -e '.[peers]'``); where it is not installed the bench drops this row and
says why (``available``).

Rounds are read as for the hf-* peers: llama.cpp decodes one token a forward, so every
token after the first is a round of one (tree size 0), timed from the previous token to
this one; the first token's time is the prefill. Its arithmetic is quantized and its own
(its kernels, its accumulation order), so its greedy text need not equal presto-sd's AR:
the bench reports how often it does (``ar_equal``), it does not hide it.
"""

from __future__ import annotations

import time

from presto_sd.app.bench.methods import BenchContext, register_method
from presto_sd.app.errors import FlagError
from presto_sd.loop.generate import GenerationParams, GenerationResult, RoundStats

NAME = "llama-cpp"
N_CTX = 4096  # prompt + output tokens a bench prompt may take


def available() -> str | None:
    """None where llama-cpp-python imports, else why this peer cannot run."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python is not installed ({e}); pip install -e '.[peers]' builds it"
    return None


def _llama(path: str, threads: int):
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads,
                 verbose=False, seed=0)


def _describe(ctx: BenchContext, params: GenerationParams) -> dict:
    import llama_cpp

    return {"gguf": ctx.gguf, "llama_cpp_python": llama_cpp.__version__, "threads": ctx.threads}


@register_method(NAME, budgeted=False, describe=_describe)
def run_llama_cpp(ctx: BenchContext, prompt_ids: list[int], params: GenerationParams) -> GenerationResult:
    if ctx.gguf is None:
        raise FlagError(f"{NAME}: no GGUF file: give --gguf (the default target's is found by itself)")
    why = available()
    if why is not None:
        raise FlagError(f"{NAME}: {why}")
    # loaded per prompt (an mmap: ~0.1 s, outside the timed span) and closed here: a model
    # kept for the process is freed by its finalizer at exit, after its library is gone
    llm = _llama(ctx.gguf, ctx.threads)
    try:
        return _decode(llm, prompt_ids, params)
    finally:
        llm.close()


def _decode(llm, prompt_ids: list[int], params: GenerationParams) -> GenerationResult:
    s = params.sampling
    greedy = s.temperature == 0
    llm.set_seed(s.seed if s.seed is not None else 0)
    sampler = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0) if greedy else dict(
        temp=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=0.0)
    tokens: list[int] = []
    times: list[float] = []
    t0 = time.perf_counter()
    for tok in llm.generate(prompt_ids, repeat_penalty=1.0, reset=True, **sampler):
        tokens.append(int(tok))
        times.append(time.perf_counter())
        if tok in params.stop_token_ids or len(tokens) >= params.max_new_tokens:
            break
    total = time.perf_counter() - t0
    prefill_s = times[0] - t0 if times else total
    rounds = [RoundStats(accepted=0, tree_size=0, draft_s=0.0, build_s=0.0, verify_s=b - a, commit_s=0.0)
              for a, b in zip(times, times[1:])]
    finish = "eos" if tokens and tokens[-1] in params.stop_token_ids else "length"
    return GenerationResult(tokens, rounds, finish, prefill_s, total - prefill_s)
