"""``presto-sd bench`` on tiny models: every output written, fields present, lossless."""

from __future__ import annotations

import json

import pytest

from presto_sd.app.bench import methods
from presto_sd.app.bench.report import machine_info
from presto_sd.app.bench.runner import BenchConfig, BenchPrompt, Job, bench, run_bench
from presto_sd.app.bench.stats import table_rows
from presto_sd.app.cli import build_parser
from presto_sd.loop.generate import GenerationParams, GenerationResult
from presto_sd.method.acceptance import SamplingParams
from presto_sd.method.builders import TreeParams
from tests.conftest import make_engines

ALL = ("ar", "hf-generate", "hf-prompt-lookup", "linear", "marginal", "presto-beam", "presto-best-first",
       "taps")
PROMPTS = [
    BenchPrompt("alpha", "a0", (0, 3, 5, 7)),
    BenchPrompt("alpha", "a1", (0, 1, 1, 2, 3, 5, 8, 13)),
    BenchPrompt("beta", "b0", (0, 9, 4, 9, 4, 9)),
]
ROW_FIELDS = {"dataset", "method", "budget", "params", "prompts", "new_tokens", "rounds", "tau",
              "tokens_per_s", "speedup", "mean_tree_size", "time_split", "lossless"}


def config(methods=ALL, budgets=(4, 16), n=16, **kw) -> BenchConfig:
    return BenchConfig(tuple(methods), budgets, GenerationParams(tree=TreeParams(), max_new_tokens=n),
                       lookup_tokens=4, **kw)


def test_bench_smoke(tiny_target, tmp_path):
    verifier, drafter = make_engines(tiny_target)
    meta = {"command": "test", "target": "tiny-llama", "drafter": "tiny",
            "machine": machine_info("cpu", "float32")}
    result = bench(verifier, drafter, PROMPTS, config(taps_cap=12), tmp_path, meta, progress=False)

    for name in ("results.json", "results.md", "runs.jsonl", "budget_sweep.png",
                 "verify_cost.png", "acceptance_hist.png", "taps_budgets.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert {"cpu", "threads", "torch", "dtype", "date"} <= set(saved["machine"])
    assert saved["config"]["budgets"] == [4, 16] and saved["command"] == "test"

    rows = saved["rows"]
    # jobs: ar, the 2 peers, linear, taps, 3 methods x 2 budgets = 11; x (2 datasets + pooled)
    assert len(rows) == 11 * 3
    for row in rows:
        assert ROW_FIELDS <= set(row), row["method"]
        assert row["lossless"] is True, (row["dataset"], row["method"], row["budget"])
        assert row["tau"] >= 1.0 and row["tokens_per_s"] > 0 and row["speedup"] > 0
        assert sum(row["time_split"].values()) == pytest.approx(1.0)
    ar = [r for r in rows if r["method"] == "ar"]
    assert all(r["tau"] == 1.0 and r["speedup"] == pytest.approx(1.0) for r in ar)
    tree_rows = [r for r in rows if r["budget"] is not None]
    assert all(r["mean_tree_size"] <= r["budget"] for r in tree_rows)
    assert max(r["tau"] for r in tree_rows) > 1.0  # trees really accept on the tiny target
    runs = (tmp_path / "runs.jsonl").read_text().splitlines()
    taps = [r for r in rows if r["method"] == "taps"]
    assert all(0 <= r["mean_tree_size"] <= 12 and r["params"]["cap"] == 12 for r in taps)
    assert len(runs) == 11 * len(PROMPTS)
    md = (tmp_path / "results.md").read_text()
    assert "| beta | presto-beam | 16 |" in md and "budget_sweep.png" in md
    assert not verifier.sessions and not drafter.sessions


def test_sampling_rows_have_no_lossless(tiny_target, tmp_path):
    verifier, drafter = make_engines(tiny_target)
    params = GenerationParams(max_new_tokens=8, sampling=SamplingParams(temperature=1.0, seed=3))
    cfg = BenchConfig(("ar", "marginal"), (8,), params, warmup=False)
    logs = run_bench(verifier, drafter, PROMPTS[:1], cfg, progress=False)
    assert [r["lossless"] for r in table_rows(logs, cfg.greedy)] == [None, None]


def test_jobs_interleave_in_rotation(monkeypatch):
    calls: list[tuple[str, int]] = []

    def record(name):
        def run(ctx, prompt_ids, params):
            calls.append((name, params.tree.budget))
            return GenerationResult([1], [], "length", 0.0, 0.0)
        return run

    for name in ("ar", "marginal"):
        monkeypatch.setitem(methods.REGISTRY, name, methods.BenchMethod(
            name, record(name), methods.REGISTRY[name].budgeted, False, core=name))
    cfg = config(methods=("marginal",), budgets=(1, 2))
    assert cfg.jobs() == [Job("ar", None), Job("marginal", 1), Job("marginal", 2)]
    logs = run_bench(None, None, PROMPTS, cfg, progress=False)
    warmup, timed = calls[:2], calls[2:]
    assert [n for n, _ in warmup] == ["ar", "marginal"]
    per_prompt = [timed[i:i + 3] for i in (0, 3, 6)]
    ar_b = ("ar", TreeParams().budget)  # unbudgeted: the base tree params untouched
    assert per_prompt == [[ar_b, ("marginal", 1), ("marginal", 2)],
                          [("marginal", 1), ("marginal", 2), ar_b],
                          [("marginal", 2), ar_b, ("marginal", 1)]]
    # the logs come back in job order, prompts in order
    assert [(r.method, r.budget, r.prompt_id) for r in logs[:3]] == [("ar", None, p.id) for p in PROMPTS]


def test_config_and_parser_errors():
    with pytest.raises(ValueError, match="unknown bench method"):
        config(methods=("ar", "nope"))
    with pytest.raises(ValueError, match="budgets"):
        config(budgets=(0,))
    args = build_parser().parse_args(["bench", "--datasets", "gsm8k", "--budgets", "8,16,32",
                                      "--methods", "ar,marginal", "--out", "x"])
    from presto_sd.app.bench.cli import bench_config

    cfg = bench_config(args, (2,), None)  # no drafter: no fitted defaults
    assert cfg.budgets == (8, 16, 32) and cfg.methods == ("ar", "marginal")
    assert cfg.params.stop_token_ids == (2,) and cfg.params.max_new_tokens == 128


def test_prompts_file_is_its_own_dataset(tmp_path):
    from presto_sd.app.bench.cli import load_bench_prompts

    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "one"}\n{"messages": [{"role": "user", "content": "two"}]}\n{"prompt": "3"}\n')
    args = build_parser().parse_args(["bench", "--prompts-file", str(f), "--n", "2"])
    prompts = load_bench_prompts(args)  # no --datasets: the file alone
    assert [(p.dataset, p.turns[0]) for p in prompts] == [("mine", "one"), ("mine", "two")]


def test_a_prompts_files_sets_each_give_n(tmp_path):
    """A file whose lines name their sets (the held-out mix, written set by set) gives the first
    N of each, as --datasets does, not the file's first N."""
    import json

    from presto_sd.app.bench.cli import load_bench_prompts

    f = tmp_path / "mix.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"{s}{k}", "dataset": s}) + "\n"
                         for s in "ab" for k in range(3)))
    prompts = load_bench_prompts(build_parser().parse_args(["bench", "--prompts-file", str(f), "--n", "2"]))
    assert [(p.dataset, p.turns[0]) for p in prompts] == [("a", "a0"), ("a", "a1"), ("b", "b0"), ("b", "b1")]


def test_the_llama_cpp_row_is_skipped_saying_why(monkeypatch, capsys):
    """Without llama-cpp-python (an optional extra) or a GGUF, bench drops the llama-cpp row
    and prints why; with them it runs on the target's own GGUF."""
    from presto_sd.app.bench import cli, gguf_peer

    args = build_parser().parse_args(["bench", "--methods", "ar,llama-cpp,marginal", "--gguf", "m.gguf"])
    monkeypatch.setattr(gguf_peer, "available", lambda: "llama-cpp-python is not installed (test)")
    assert cli.bench_config(args, (2,), None).methods == ("ar", "marginal")
    assert "llama-cpp skipped: llama-cpp-python is not installed (test)" in capsys.readouterr().err
    monkeypatch.setattr(gguf_peer, "available", lambda: None)
    cfg = cli.bench_config(args, (2,), None)
    assert cfg.methods == ("ar", "llama-cpp", "marginal") and cfg.gguf == "m.gguf"
    no_gguf = build_parser().parse_args(["bench", "--methods", "ar,llama-cpp", "--target", "some/dir"])
    assert cli.bench_config(no_gguf, (2,), None).methods == ("ar",)
    assert "is not a .gguf file" in capsys.readouterr().err


@pytest.mark.smollm2
def test_llama_cpp_decodes_the_targets_own_gguf(smollm2_dir):
    """The peer row on the real SmolLM2 GGUF: greedy tokens, one round per token after the
    first; how often its text is the engine's AR is the bench's to report (``ar_equal``)."""
    from presto_sd.app.bench import gguf_peer
    from presto_sd.models.loading import encode_messages, load_tokenizer, target_gguf

    why = gguf_peer.available()
    if why is not None:
        pytest.skip(why)
    ctx = methods.BenchContext(None, None, gguf=str(target_gguf(None)), threads=2)
    params = GenerationParams(max_new_tokens=12, stop_token_ids=(2,))
    prompt = encode_messages(load_tokenizer(None), [{"role": "user", "content": "Name three colours."}])
    res = gguf_peer.run_llama_cpp(ctx, prompt, params)
    again = gguf_peer.run_llama_cpp(ctx, prompt, params)
    assert 1 <= len(res.token_ids) <= 12 and res.token_ids == again.token_ids  # greedy: the same twice
    assert len(res.rounds) == len(res.token_ids) - 1 and all(r.tree_size == 0 for r in res.rounds)
    assert res.prefill_s > 0 and res.decode_s >= 0
