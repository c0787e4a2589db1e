"""The corpus's second plan: requests the target writes itself, kept in the repo, then answered."""

from __future__ import annotations

import pytest
import torch

from presto_sd.app.training import corpus as corpus_module
from presto_sd.app.training.corpus import DECONTAMINATION_N, _ngrams, item_source
from presto_sd.app.training.grow_corpus import GrowConfig, grow_corpus
from presto_sd.app.training.magpie import MagpieConfig, run_magpie, user_turn_prefix
from presto_sd.app.training.token_corpus import Corpus, CorpusError, PromptChunks
from presto_sd.models.loading import encode_messages, load_target

LEAKED = "A baker puts twelve loaves on each of seven shelves and sells all of them"  # a "benchmark" text


@pytest.fixture
def chatty_target(tiny_target_dir, monkeypatch):
    """The tiny random target, its end-of-turn logit raised so that sampled requests end
    within a few tokens (a random 49k-token head almost never samples it), and a benchmark
    whose one question the decontamination must catch."""
    model, tok = load_target(str(tiny_target_dir), torch.device("cpu"), torch.float32)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    bias = torch.zeros(model.config.vocab_size)
    bias[end] = 11.0
    model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    monkeypatch.setattr(corpus_module, "benchmark_ngrams", lambda n=DECONTAMINATION_N: _ngrams(LEAKED, n))
    return model, tok


def _config(tmp_path, **kw) -> MagpieConfig:
    return MagpieConfig(**{"prompts": str(tmp_path / "prompts"), "corpus": str(tmp_path / "corpus"),
                           "chunks": 2, "chunk_size": 6, "max_query_tokens": 12, "min_words": 1,
                           "max_new_tokens": 6, "dtype": "float32", **kw})


def test_the_user_turn_prefix_is_the_template_up_to_the_request(smollm2_dir):
    from presto_sd.models.loading import load_tokenizer

    tok = load_tokenizer(str(smollm2_dir))
    prefix = user_turn_prefix(tok)
    assert prefix.endswith("<|im_start|>user\n") and "system" in prefix
    full = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False)
    assert full.startswith(prefix) and full[len(prefix):].startswith("Hi there")


def test_requests_are_sampled_kept_and_answered_and_more_chunks_only_append(chatty_target, tmp_path):
    model, tok = chatty_target
    cfg = _config(tmp_path)
    run_magpie(cfg, model, tok)
    chunks, answers = PromptChunks(cfg.prompts), Corpus(cfg.corpus)
    m = chunks.manifest()
    assert chunks.indices() == [0, 1] and answers.indices() == [0, 1]
    for i in (0, 1):
        entry, requests = m["chunks"][str(i)], chunks.read(i)
        assert entry["sampled"] == 6 and entry["kept"] == len(requests) > 0
        assert entry["cpu"] and entry["dtype"] == "float32" and entry["command"]
        assert all(r.strip() == r and r for r in requests)
        assert len({r.lower() for r in requests}) == len(requests)
        shard = answers.read(i)  # shard i answers chunk i: its requests as user turns, shortest first
        want = sorted(((f"magpie/{i}/{k}", encode_messages(tok, [{"role": "user", "content": r}]))
                       for k, r in enumerate(requests)), key=lambda e: len(e[1]))
        assert [(a, list(p)) for a, p in zip(shard.item_ids, shard.prompts)] == want
        assert all(0 < len(r) <= 6 for r in shard.responses)
        assert {item_source(a) for a in shard.item_ids} == {"magpie"}
    before = {p.name: p.read_bytes() for p in (*chunks.root.glob("chunk_*"), *answers.root.glob("shard_*"))}
    run_magpie(_config(tmp_path, chunks=3), model, tok)  # resumed, one chunk more
    assert chunks.indices() == [0, 1, 2] and answers.indices() == [0, 1, 2]
    assert all((chunks.root / n if n.startswith("chunk") else answers.root / n).read_bytes() == b
               for n, b in before.items())  # nothing committed moved


def test_a_leaked_request_never_reaches_the_corpus(chatty_target, tmp_path):
    model, tok = chatty_target
    cfg = _config(tmp_path, chunks=1, answer=False)
    run_magpie(cfg, model, tok)
    chunks = PromptChunks(cfg.prompts)
    kept = chunks.read(0)
    made = chunks.manifest()["chunks"]["0"]
    chunks.write(0, [*kept, "Please solve this: " + LEAKED], made["sampled"], {"command": "planted"})
    grow_corpus(GrowConfig(corpus=cfg.corpus, sources="magpie", prompts=cfg.prompts, max_new_tokens=4,
                           dtype="float32"), model, tok)
    shard = Corpus(cfg.corpus).read(0)
    assert len(shard.item_ids) == len(kept) and f"magpie/0/{len(kept)}" not in shard.item_ids


def test_a_request_start_steers_every_request_and_is_part_of_the_folders_key(chatty_target, tmp_path):
    model, tok = chatty_target
    start = "Solve this word problem step by step:"
    cfg = _config(tmp_path, chunks=1, answer=False, request_start=f"  {start} ", min_words=2)
    assert cfg.request_start == start
    run_magpie(cfg, model, tok)
    chunks = PromptChunks(cfg.prompts)
    requests = chunks.read(0)
    assert requests and all(r.startswith(start) for r in requests)
    assert all(len(r[len(start):].split()) >= 2 for r in requests)  # the target's own words
    assert chunks.manifest()["key"]["prefix"] == user_turn_prefix(tok) + start
    with pytest.raises(CorpusError, match=r"differs in prefix"):  # a free run into a steered folder
        run_magpie(_config(tmp_path, chunks=1, answer=False, min_words=2), model, tok)
    free = _config(tmp_path / "free", chunks=1, min_words=2)
    run_magpie(free, model, tok)
    with pytest.raises(CorpusError, match=r"differs in prefix"):  # and a steered run into a free one
        run_magpie(_config(tmp_path / "free", chunks=1, min_words=2, request_start=start), model, tok)
    forgot = _config(tmp_path, prompts=str(tmp_path / "steered2"), corpus=free.corpus, chunks=1,
                     request_start=start)
    with pytest.raises(CorpusError, match=r"made by another plan"):  # the free plan's --corpus, forgotten:
        run_magpie(forgot, model, tok)
    assert not (tmp_path / "steered2").exists()  # refused before a request was sampled


def test_edited_chunks_other_settings_and_a_missing_folder_are_refused(chatty_target, tmp_path):
    model, tok = chatty_target
    cfg = _config(tmp_path, chunks=1, answer=False)
    run_magpie(cfg, model, tok)
    with pytest.raises(CorpusError, match=r"differs in temperature"):
        run_magpie(_config(tmp_path, chunks=1, answer=False, temperature=0.7), model, tok)
    path = PromptChunks(cfg.prompts).root / "chunk_00000.jsonl.xz"
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    with pytest.raises(CorpusError, match="sha256 differs"):
        PromptChunks(cfg.prompts).read(0)
    with pytest.raises(ValueError, match="--sources magpie needs --prompts"):
        grow_corpus(GrowConfig(corpus=str(tmp_path / "c2"), sources="magpie", dtype="float32"), model, tok)


def test_plan_keys_hold_no_checkout_path_and_the_first_plans_is_unchanged():
    from presto_sd.app.training.grow_corpus import plan_key

    key = plan_key(GrowConfig())
    assert "prompts" not in key  # and another checkout's path to the same folder is the same plan:
    assert plan_key(GrowConfig(sources="magpie", prompts="/a/corpus/prompts/p"))["prompts"] == "p"
    assert plan_key(GrowConfig(sources="magpie", prompts="corpus/prompts/p/")) == plan_key(
        GrowConfig(sources="magpie", prompts="/elsewhere/corpus/prompts/p"))
    committed = Corpus("corpus/smollm2-135m").manifest()["plan_key"]
    assert key == committed  # the repo corpus resumes as it was made


def test_the_committed_second_plan_resumes_with_the_default_flags(smollm2_dir):
    """A fresh checkout runs `presto-sd train magpie` with its defaults: the committed prompts
    and answers must be what those flags make, or the job would refuse them."""
    from presto_sd.app.training.grow_corpus import plan_key
    from presto_sd.app.training.magpie import DEFAULT_MAGPIE_CORPUS, DEFAULT_PROMPTS, answer_config
    from presto_sd.app.training.magpie import prompt_key as sampling_key
    from presto_sd.models.loading import load_tokenizer

    committed = Corpus(DEFAULT_MAGPIE_CORPUS).manifest()
    assert committed["plan_key"] == plan_key(answer_config(MagpieConfig()))
    prompts = PromptChunks(DEFAULT_PROMPTS)
    prefix = user_turn_prefix(load_tokenizer(str(smollm2_dir)))
    assert prompts.manifest()["key"] == sampling_key(MagpieConfig(), prefix)
    for i in prompts.indices():  # every chunk file is there, as its manifest says
        assert prompts.read(i)


def test_the_committed_math_plan_resumes_with_its_documented_flags(smollm2_dir):
    """docs/training.md's command for the third plan (`--request-start`, its two folders) must
    make the committed folders' keys, or resuming it on a fresh machine would be refused."""
    from presto_sd.app.training.grow_corpus import plan_key
    from presto_sd.app.training.magpie import (
        MATH_CORPUS,
        MATH_PROMPTS,
        MATH_REQUEST_START,
        answer_config,
        prompt_key,
        sampling_prefix,
    )
    from presto_sd.models.loading import load_tokenizer

    cfg = MagpieConfig(request_start=MATH_REQUEST_START, prompts=MATH_PROMPTS, corpus=MATH_CORPUS)
    assert Corpus(MATH_CORPUS).manifest()["plan_key"] == plan_key(answer_config(cfg))
    prompts = PromptChunks(MATH_PROMPTS)
    tok = load_tokenizer(str(smollm2_dir))
    assert prompts.manifest()["key"] == prompt_key(cfg, sampling_prefix(tok, cfg))
    for i in prompts.indices():
        assert all(r.startswith(MATH_REQUEST_START) for r in prompts.read(i))
    for i in Corpus(MATH_CORPUS).indices():
        assert Corpus(MATH_CORPUS).read(i).item_ids  # every shard there, as its manifest says
    docs = open("docs/training.md").read()
    assert f'--request-start "{MATH_REQUEST_START}"' in docs and MATH_PROMPTS in docs and MATH_CORPUS in docs

