"""``presto-sd train link``: one warm-start link end to end on a tiny target, its choices made
on held-out prompts (never a benchmark), resumable, and its refusals."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from presto_sd.app.training.acceptance import AcceptanceConfig, train_acceptance
from presto_sd.app.training.export import add_prefix_head, export_drafter
from presto_sd.app.training.features import materialize
from presto_sd.app.training.grow_corpus import GrowConfig, grow_corpus
from presto_sd.app.training.held_out_replay import choice_score
from presto_sd.app.training.link import LinkConfig, LinkError, run_link
from presto_sd.app.training.train_drafter import TrainConfig, train_drafter
from presto_sd.models.assets import file_digests, write_digests
from presto_sd.models.dflash import DFlashDraftModel
from presto_sd.models.loading import load_target, sha256_of

GROW = dict(sources="code,arith", n_code=8, n_arith=8, max_new_tokens=24, batch_size=4, dtype="float32")


@pytest.fixture(scope="module")
def chain(tiny_target_dir, tmp_path_factory):
    """A corpus of 4 shards and a parent drafter trained on shard 0 (predictors from shard 1)."""
    root = tmp_path_factory.mktemp("link")
    mp = pytest.MonkeyPatch()
    mp.setenv("PRESTO_SD_CACHE", str(root / "cache"))
    model, tok = load_target(str(tiny_target_dir), torch.device("cpu"), torch.float32)
    grow = GrowConfig(corpus=str(root / "corpus"), target=str(tiny_target_dir), **GROW)
    corpus = grow_corpus(grow, model, tok)
    data = materialize(corpus, root / "data0", model, str(tiny_target_dir), (0, 1), max_shards=1)
    run = train_drafter(TrainConfig(
        data=str(data), out=str(root / "run0"), target=str(tiny_target_dir), num_layers=1, block_size=4,
        draft_vocab=64, anchors_per_seq=4, batch_seqs=2, steps=20, lr=3e-3, warmup=2, log_every=5,
        ckpt_every=20, heldout_seqs=1))
    parent = export_drafter(run, root / "parent")
    train_acceptance(AcceptanceConfig(drafter=str(parent), data=str(data), target=str(tiny_target_dir),
                                      n_prompts=4, max_new_tokens=8, budget=8, depth=3, epochs=20,
                                      corpus=str(corpus), corpus_from_shard=1))
    prompts = root / "heldout.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Name a colour.", "Count to 5.")))
    yield root, corpus, parent, prompts, tiny_target_dir
    mp.undo()


def link_config(chain, work: str, **kw) -> LinkConfig:
    root, corpus, parent, prompts, target = chain
    base = dict(work=str(root / work), first_shard=1, shards=1, parent=str(parent), corpus=str(corpus),
                target=str(target), steps=10, batch_seqs=2, heldout_seqs=1, ckpt_every=10,
                acceptance_prompts=4, acceptance_tokens=8, choose_on=str(prompts), choose_n=2,
                budgets=(2, 4), max_new_tokens=8, dtype="float32")
    return LinkConfig(**{**base, **kw})


def test_a_link_trains_chooses_on_held_out_prompts_and_resumes(chain):
    cfg = link_config(chain, "link1")
    report = run_link(cfg)
    work, candidate = chain[0] / "link1", chain[0] / "link1" / "candidate"
    assert json.loads((work / "link_report.json").read_text()) == report
    by_rho = report["candidate"]["tau_by_rho"]
    # ngram-lookup proposes its own candidates: its lambda chosen by the replay for the candidate
    assert set(by_rho) == {"hphi", "ngram", "ngram-lookup"} and report["candidate"]["rho"] in by_rho
    assert all(f"presto-best-first@{b}" in taus for taus in by_rho.values() for b in (2, 4))
    parent_by_rho = report["parent"]["tau_by_rho"]  # each drafter at its own best rho, of one menu
    assert set(parent_by_rho) == set(by_rho)
    lookup_lambda = json.loads((candidate / "presto.json").read_text())["lambdas_by_rho"]["ngram-lookup"]
    replayed = json.loads((work / "choice" / "parent-ngram-lookup" / "replay.json").read_text())
    assert all(r["params"]["lambdas"] == lookup_lambda  # the parent has none: the candidate's
               for r in replayed["rows"] if r["method"] == "presto-best-first")
    assert {"linear", "presto-best-first@2"} <= set(parent_by_rho["hphi"])
    assert isinstance(report["wins"], bool) and report["score"]["candidate"] >= 1.0
    # judged where `train acceptance` fitted the lambdas: ngram-lookup's was chosen on these prompts
    assert {report["candidate"]["judged_at"], report["parent"]["rho"]} <= {"hphi", "ngram"}
    judged = by_rho[report["candidate"]["judged_at"]]
    assert report["score"]["candidate"] == round(choice_score(judged, (2, 4)), 4)
    # the chosen rho is what the candidate's presto.json names, and its digests still hold
    presto = json.loads((candidate / "presto.json").read_text())
    assert presto["rho"] == report["candidate"]["rho"]
    assert presto["lambdas"] == presto["lambdas_by_rho"][presto["rho"]]
    assert json.loads((candidate / "sha256.json").read_text()) == file_digests(candidate)
    # it trained from the parent, on the shard after the parent's, its predictors from the next
    assert json.loads((work / "data" / "meta.json").read_text())["first_shard"] == 1
    assert json.loads((candidate / "acceptance_report.json").read_text())["config"]["corpus_from_shard"] == 2
    # the candidate is the trained weights averaged with the parent's (--average 0.5), rounded once to bf16
    trained, parent = (DFlashDraftModel.load(p).state_dict() for p in (work / "run" / "drafter", chain[2]))
    shipped = DFlashDraftModel.load(candidate, torch.bfloat16).state_dict()
    midpoint = {k: (0.5 * parent[k] + 0.5 * trained[k]).to(torch.bfloat16) for k in parent}
    assert all(torch.equal(v, midpoint[k]) for k, v in shipped.items())
    assert not all(torch.equal(parent[k], trained[k]) for k in parent)
    # resumed: every step is found done, nothing is redone
    stamps = {p: p.stat().st_mtime_ns for p in work.rglob("*")
              if p.is_file() and p.name != "link_report.json"}
    assert run_link(cfg) == report
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_a_link_carried_to_another_machine_after_its_fit_needs_no_features(chain, monkeypatch):
    """A link dir whose candidate is fitted (its digests written), carried without data/ and
    run/ (a new machine's empty cache, the candidate and the choice kept), goes on at the
    choice: no feature is prefilled and nothing is trained again."""
    import shutil

    from presto_sd.app.training import link

    cfg = link_config(chain, "carried", steps=5)
    monkeypatch.setattr(link, "_proposing_lambdas", lambda *a: None)  # stop after the fit
    monkeypatch.setattr(link, "_choose", lambda *a: {"stopped": True})
    run_link(cfg)
    work = chain[0] / "carried"
    for d in [work / "data", work / "run", *work.glob("*-data")]:
        shutil.rmtree(d, ignore_errors=True)
    work = work.rename(chain[0] / "carried-elsewhere")  # another machine's path
    cfg = replace(cfg, work=str(work))
    monkeypatch.undo()

    def no_features(*a, **k):
        raise AssertionError("a fitted candidate's link prefilled features")

    monkeypatch.setattr(link, "_features", no_features)
    monkeypatch.setattr(link, "_train", no_features)
    report = run_link(cfg)
    assert isinstance(report["wins"], bool) and "ngram-lookup" in report["candidate"]["tau_by_rho"]


def test_a_link_refuses_a_benchmark_to_choose_on_and_a_window_the_corpus_cannot_fill(chain):
    for bench in ("gsm8k", "humaneval", "mtbench", "sharegpt,gsm8k", " mtbench ,"):
        with pytest.raises(LinkError, match="benchmark"):
            run_link(link_config(chain, "refused", choose_on=bench))
    with pytest.raises(LinkError, match="0 prompts in its shards from 4 on"):
        run_link(link_config(chain, "refused", first_shard=3))
    with pytest.raises(LinkError, match="lacks \\[4, 5\\]"):
        run_link(link_config(chain, "refused", first_shard=3, shards=3))
    for what in ("Heldout-Mix", "nowhere.jsonl", "sharegpt,nope", ""):  # a typo fails now, not after training
        with pytest.raises(LinkError, match="is neither heldout-mix"):
            run_link(link_config(chain, "refused", choose_on=what))
    with pytest.raises(LinkError, match="at least 1 prompt"):
        run_link(link_config(chain, "refused", choose_n=0))
    for share in (0.0, 1.5):
        with pytest.raises(LinkError, match="--average"):
            run_link(link_config(chain, "refused", average=share))
    with pytest.raises(LinkError, match="grow-layers"):
        run_link(link_config(chain, "refused", grow_layers=1))
    with pytest.raises(LinkError, match="asks 9"):  # shards 2-3 hold 8 prompts
        run_link(link_config(chain, "refused", acceptance_prompts=9))
    with pytest.raises(LinkError, match="lies in the window 1-2"):
        run_link(link_config(chain, "refused", shards=2, acceptance_from_shard=2))
    with pytest.raises(LinkError, match="4 prompts in its shards from 3 on"):
        run_link(link_config(chain, "refused", acceptance_from_shard=3, acceptance_prompts=5))
    assert not (chain[0] / "refused").exists()  # refused before it wrote anything


def test_a_link_over_an_early_window_fits_its_predictors_where_it_is_told(chain):
    """A window the chain saw long ago (shard 0 here, the parent's own) traces its predictors
    on the shards named, not on the ones right after it."""
    run_link(link_config(chain, "early", first_shard=0, steps=5, choose_n=1, acceptance_from_shard=3,
                         acceptance_prompts=2))
    acceptance = json.loads((chain[0] / "early" / "candidate" / "acceptance_report.json").read_text())
    assert acceptance["config"]["corpus_from_shard"] == 3


def test_the_cli_types_an_optional_shard_as_an_int():
    import argparse

    from presto_sd.app.training.cli import _to_config, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    argv = ["train", "link", "--work", "w", "--first-shard", "0", "--shards", "3"]
    assert _to_config(LinkConfig, parser.parse_args(argv)).acceptance_from_shard is None
    cfg = _to_config(LinkConfig, parser.parse_args([*argv, "--acceptance-from-shard", "700"]))
    assert cfg.acceptance_from_shard == 700 and cfg.first_shard == 0


def test_a_link_dir_resumes_only_with_its_own_settings(chain):
    run_link(link_config(chain, "settings", steps=5, choose_n=1))
    with pytest.raises(LinkError, match="other settings \\(lr, steps\\)"):
        run_link(link_config(chain, "settings", steps=6, lr=1e-3, choose_n=1))
    # a dir made before a setting was added resumes: the missing key reads as its default
    settings = chain[0] / "settings" / "link.json"
    made = json.loads(settings.read_text())
    del made["written"]
    settings.write_text(json.dumps(made))
    run_link(link_config(chain, "settings", steps=5, choose_n=1))
    # ... as what such a dir did: before --average, a candidate was its trained weights alone
    del made["average"]
    settings.write_text(json.dumps(made))
    with pytest.raises(LinkError, match="\\(average\\) \\(made before --average.*--average 1\\)"):
        run_link(link_config(chain, "settings", steps=5, choose_n=1))
    run_link(link_config(chain, "settings", steps=5, choose_n=1, average=1.0))


def test_a_link_with_written_answers_trains_on_both_with_the_targets_labels(chain, monkeypatch):
    from presto_sd.app.training import written
    from presto_sd.app.training.token_corpus import Corpus

    items = Corpus(chain[1]).read(1).item_ids  # the tiny corpus has no ShareGPT: answer its items
    answers = {item: f"Here is my answer number {k}, written by hand." for k, item in enumerate(items[:3])}
    monkeypatch.setattr(written, "sharegpt_answers", lambda split: answers)
    run_link(link_config(chain, "written", steps=5, choose_n=1, written=True))
    work = chain[0] / "written"
    kept = Corpus(work / "written-corpus").read(1).item_ids
    # the answered items, and the code items that ask for a stdlib function (its source answers)
    assert set(answers) <= set(kept) and all(i.startswith("code/") for i in set(kept) - set(answers))
    meta = json.loads((work / "written-data" / "meta.json").read_text())
    assert meta["shards"] == 1 and meta["prefilled_tokens"] > 0
    report = json.loads((work / "run" / "drafter" / "training_report.json").read_text())
    assert report["config"]["data"] == f"{work / 'data'},{work / 'written-data'}"
    assert report["config"]["hard_labels"] == "target"
    assert report["train_sequences"] + report["config"]["heldout_seqs"] == len(items) + len(kept)
    acceptance = json.loads((work / "candidate" / "acceptance_report.json").read_text())
    assert acceptance["config"]["data"] == str(work / "data")  # the n-gram table: the target's own text


def test_an_n_gram_table_from_no_shards_is_refused(tmp_path):
    from presto_sd.app.training.acceptance import build_ngram_table

    with pytest.raises(ValueError, match="no shards there"):  # e.g. several --data dirs named as one
        build_ngram_table(f"{tmp_path / 'a'},{tmp_path / 'b'}", 3, 64)


def test_a_link_mixes_in_windows_of_other_corpora(chain):
    """``--mix CORPUS:FIRST:SHARDS``: the window's answers and the mixed-in window's train the
    candidate together, and the n-gram rho table is fitted on both (a link over one kind of
    text alone pulled the drafter off the others)."""
    from presto_sd.app.training.token_corpus import Corpus

    corpus = chain[1]
    run_link(link_config(chain, "mixed", steps=5, choose_n=1, mix=f"{corpus}:0:1"))
    work = chain[0] / "mixed"
    both = f"{work / 'data'},{work / 'mix0-data'}"
    report = json.loads((work / "run" / "drafter" / "training_report.json").read_text())
    assert report["config"]["data"] == both
    seqs = sum(len(Corpus(corpus).read(i).item_ids) for i in (0, 1))
    assert report["train_sequences"] + report["config"]["heldout_seqs"] == seqs
    assert json.loads((work / "mix0-data" / "meta.json").read_text())["first_shard"] == 0
    acceptance = json.loads((work / "candidate" / "acceptance_report.json").read_text())
    assert acceptance["config"]["data"] == both


def test_a_link_refuses_a_malformed_or_unfilled_mix_window(chain):
    corpus = chain[1]
    for spec in ("nowhere", f"{corpus}:1", f"{corpus}:a:1", f"{corpus}:0:0", f"{corpus}:-1:1", ":0:1"):
        with pytest.raises(LinkError, match="CORPUS:FIRST:SHARDS"):
            run_link(link_config(chain, "refused-mix", mix=spec))
    with pytest.raises(LinkError, match="lacks \\[4, 5\\]"):
        run_link(link_config(chain, "refused-mix", mix=f"{corpus}:3:3"))
    assert not (chain[0] / "refused-mix").exists()


def test_a_link_chooses_on_the_held_out_mix_by_default(chain, monkeypatch):
    """The default choice set holds code and arithmetic beside chat (the eleventh link moved
    toward chat, won on ShareGPT alone and lost math and code): written once in the link's dir,
    replayed with a row per set and the pooled row the verdict reads."""
    from presto_sd.app.training import link
    from presto_sd.app.training.choose_set import MIX_SETS

    assert LinkConfig(work="w", first_shard=0, shards=1).choose_on == "heldout-mix"
    written = []

    def small_mix(path, n, corpora):  # the real one's sets, with prompts a tiny target answers quickly
        written.append((n, corpora))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"prompt": f"Say {k}.", "dataset": name}) + "\n"
                                for name in MIX_SETS for k in range(n)))
        return path

    monkeypatch.setattr(link, "write_heldout_mix", small_mix)
    cfg = link_config(chain, "mix-choice", steps=5, choose_n=1, choose_on="heldout-mix")
    report = run_link(cfg)
    choice = chain[0] / "mix-choice" / "choice"
    rows = json.loads((choice / "candidate-hphi" / "replay.json").read_text())["rows"]
    assert {r["dataset"] for r in rows} == {*MIX_SETS, "all"}
    # one file, both drafters, none of its prompts the plans' of the corpus trained on
    assert (choice / "heldout-mix.jsonl").is_file() and written == [(1, (str(chain[1]),))]
    assert report["prompts"]["sha256"] == sha256_of(choice / "heldout-mix.jsonl")
    for who in ("candidate", "parent"):  # each set's taus at the drafter's best rho, in the report
        by_set = report[who]["by_set"]
        assert list(by_set) == list(MIX_SETS)
        assert all(set(t) == {"presto-best-first@2", "presto-best-first@4"} for t in by_set.values())
    assert run_link(cfg) == report and len(written) == 1
    # a dir that chose on another set says which, to resume it
    with pytest.raises(LinkError, match="--choose-on heldout-mix"):
        run_link(link_config(chain, "mix-choice", steps=5, choose_n=1, choose_on="sharegpt"))


def test_a_prefix_heads_lambda_is_chosen_on_held_out_prompts_and_a_link_keeps_it(chain):
    """``prefix-ngram`` proposes its own children, so `train acceptance` cannot fit its lambda:
    ``choose_lambda`` picks it from a grid by the replay (into presto.json, digests kept true),
    refuses a drafter without a head changing nothing, and a link from a parent with a head
    chooses the candidate's before the verdict, so both drafters are judged with it."""
    import shutil

    from presto_sd.app.training.choose_lambda import choose_lambda

    root, _, parent, prompts, target = chain
    flags = ["--prompts-file", str(prompts), "--datasets", "", "--n", "2"]
    before = (parent / "presto.json").read_bytes()
    with pytest.raises(ValueError, match="prefix-ngram"):  # no head: no such rho
        choose_lambda(parent, flags, root / "no-head", budgets=(2,), max_new_tokens=8, target=str(target))
    assert (parent / "presto.json").read_bytes() == before

    head_run = train_drafter(TrainConfig(
        data=str(root / "data0"), out=str(root / "head-run"), target=str(target), anchors_per_seq=4,
        batch_seqs=2, steps=5, warmup=1, ckpt_every=5, heldout_seqs=1, prefix_rank=4,
        init_drafter=str(parent), prefix_only=True))
    headed = root / "headed"  # the parent and its predictors, the head put in by `train add-head`
    shutil.copytree(parent, headed)
    other = export_drafter(train_drafter(TrainConfig(  # a head on another drafter: refused
        data=str(root / "data0"), out=str(root / "other-run"), target=str(target), num_layers=1,
        block_size=4, draft_vocab=64, anchors_per_seq=4, batch_seqs=2, steps=2, warmup=1, ckpt_every=2,
        heldout_seqs=1, prefix_rank=4, seed=1)), root / "other")
    with pytest.raises(ValueError, match="not .*'s: a head is trained on"):
        add_prefix_head(other, headed)
    assert file_digests(headed) == file_digests(parent)  # refused: nothing changed
    add_prefix_head(head_run, headed)
    assert (headed / "model.safetensors").read_bytes() == (parent / "model.safetensors").read_bytes()
    assert json.loads((headed / "config.json").read_text())["dflash_config"]["prefix_head_rank"] == 4
    assert (headed / "prefix_head_report.json").is_file()
    assert json.loads((headed / "sha256.json").read_text()) == file_digests(headed)
    report = choose_lambda(headed, flags, root / "lambda", grid=(0.0, 0.5), budgets=(2, 4),
                           max_new_tokens=8, target=str(target), make_default=True)
    presto = json.loads((headed / "presto.json").read_text())
    assert set(report["score_by_lambda"]) == {"0", "0.5"} and report["lambda"] in (0.0, 0.5)
    assert presto["lambdas_by_rho"]["prefix-ngram"] == [report["lambda"]]
    assert report["default_score"] is not None and presto["rho"] == report["default_now"]
    assert json.loads((headed / "sha256.json").read_text()) == file_digests(headed)
    # a rerun of `train acceptance` refits the others and keeps the lambda chosen by the replay,
    # and a proposing default (the replay chose it; a refit cannot judge it)
    presto.update(rho="prefix-ngram", lambdas=presto["lambdas_by_rho"]["prefix-ngram"])
    (headed / "presto.json").write_text(json.dumps(presto))
    write_digests(headed)
    train_acceptance(AcceptanceConfig(drafter=str(headed), data=str(root / "data0"), target=str(target),
                                      n_prompts=4, max_new_tokens=8, budget=8, depth=3, epochs=2,
                                      corpus=str(chain[1]), corpus_from_shard=1))
    refit_presto = json.loads((headed / "presto.json").read_text())
    refit = refit_presto["lambdas_by_rho"]
    assert refit["prefix-ngram"] == [report["lambda"]] and {"hphi", "ngram", "prefix"} <= set(refit)
    assert (refit_presto["rho"], refit_presto["lambdas"]) == ("prefix-ngram", [report["lambda"]])
    assert json.loads((headed / "sha256.json").read_text()) == file_digests(headed)
    # a refit whose n-gram table differs (here its order): the replay chose that lambda with the
    # old table, so it goes, and the proposing default with it
    stale = root / "headed-stale"
    shutil.copytree(headed, stale)
    train_acceptance(AcceptanceConfig(drafter=str(stale), data=str(root / "data0"), target=str(target),
                                      n_prompts=4, max_new_tokens=8, budget=8, depth=3, epochs=2,
                                      corpus=str(chain[1]), corpus_from_shard=1, ngram_order=2))
    stale_presto = json.loads((stale / "presto.json").read_text())
    assert "prefix-ngram" not in stale_presto["lambdas_by_rho"] and stale_presto["rho"] != "prefix-ngram"
    assert stale_presto["lambdas"] == stale_presto["lambdas_by_rho"][stale_presto["rho"]]
    with pytest.raises(ValueError, match="another head or other settings"):  # its replays are not these
        choose_lambda(headed, flags, root / "lambda", grid=(0.0,), budgets=(2,), max_new_tokens=8,
                      target=str(target))
    with pytest.raises(ValueError, match="train acceptance"):  # a rescoring rho is fitted, not chosen
        choose_lambda(headed, flags, root / "lambda-ngram", rho="ngram", target=str(target))

    cfg = link_config(chain, "headed-link", parent=str(headed), steps=5, choose_n=1)
    linked = run_link(cfg)
    assert all("prefix-ngram" in linked[who]["tau_by_rho"] for who in ("candidate", "parent"))
    # reported, never chosen: its tree building costs what a replay does not see
    assert "prefix-ngram" not in (linked["candidate"]["rho"], linked["parent"]["rho"])
    candidate = json.loads((root / "headed-link" / "candidate" / "presto.json").read_text())
    assert candidate["lambdas_by_rho"]["prefix-ngram"][0] in (0.0, 0.1, 0.25, 0.5, 1.0)
    # a head put in over another: the lambdas chosen for the old one go, its rho falls back
    again = root / "headed-again"
    shutil.copytree(headed, again)
    presto = json.loads((again / "presto.json").read_text())
    presto.update(rho="prefix-ngram", lambdas=presto["lambdas_by_rho"]["prefix-ngram"])
    (again / "presto.json").write_text(json.dumps(presto))
    add_prefix_head(head_run, again)
    presto = json.loads((again / "presto.json").read_text())
    assert presto["rho"] == "ngram" and presto["lambdas"] == presto["lambdas_by_rho"]["ngram"]
    assert not {"prefix", "prefix-ngram"} & set(presto["lambdas_by_rho"])
