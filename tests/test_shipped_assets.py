"""The shipped drafter is guarded offline: its files are the ones its digests name, and a
drafter dir without weights is refused, never replaced by random weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from presto_sd.models.assets import DIGESTS_FILE, DrafterAssetError, DrafterAssets, file_digests
from presto_sd.models.loading import DEFAULT_DRAFTER


def test_every_shipped_drafter_file_matches_its_digest():
    """Fails (never skips) on an edited, truncated or LFS-pointer file, or one left out."""
    want = json.loads((DEFAULT_DRAFTER / DIGESTS_FILE).read_text())
    have = file_digests(DEFAULT_DRAFTER)
    assert {"config.json", "model.safetensors", "prefix_head.safetensors", "presto.json",
            "ngram.json.gz"} <= set(want)
    assert have == want, sorted(f for f in set(want) | set(have) if want.get(f) != have.get(f))


def test_a_drafter_dir_without_weights_is_refused(tmp_path):
    broken = tmp_path / "drafter"
    shutil.copytree(DEFAULT_DRAFTER, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(DrafterAssetError, match=r"no weights \(\*\.safetensors\)"):
        DrafterAssets.read(broken)
    (broken / DIGESTS_FILE).unlink()  # without digests too: the weights are what is missing
    with pytest.raises(DrafterAssetError, match="no weights"):
        DrafterAssets.read(broken)
    (broken / "config.json").unlink()
    with pytest.raises(DrafterAssetError, match="no config.json"):
        DrafterAssets.read(broken)


def test_an_edited_drafter_file_is_refused(tmp_path):
    edited = tmp_path / "drafter"
    shutil.copytree(DEFAULT_DRAFTER, edited)
    lambdas = json.loads((edited / "presto.json").read_text())
    lambdas["lambdas"] = [0.0] * len(lambdas["lambdas"])
    (edited / "presto.json").write_text(json.dumps(lambdas))
    with pytest.raises(DrafterAssetError, match="presto.json missing or differing"):
        DrafterAssets.read(edited)
    assert DrafterAssets.read(DEFAULT_DRAFTER).defaults.lambdas  # the shipped one reads


def test_the_loader_refuses_a_broken_default_drafter(tmp_path, monkeypatch):
    """With the default target and no --drafter, a shipped dir that lost its weights stops the
    load; it does not fall back to the random drafter as a missing target's drafter would."""
    from presto_sd.embedded import stack
    from presto_sd.models import loading

    broken = tmp_path / "smollm2-135m"
    shutil.copytree(DEFAULT_DRAFTER, broken)
    (broken / "model.safetensors").unlink()
    monkeypatch.setattr(loading, "DEFAULT_DRAFTER", broken)
    with pytest.raises(DrafterAssetError):
        stack.drafter_assets(None, None)


# Floors well under what the shipped drafter reaches on these prompts (docs/training.md): a
# broken checkpoint, n-gram table, h_phi or lambdas (tau ~1.0) cannot pass. Measured 1.75
# (bf16, 2026-12-03).
DEFAULT_METHOD_FLOOR = 1.4


@pytest.mark.smollm2
def test_the_cli_default_method_still_accepts_with_the_shipped_assets():
    """The CLI's own defaults (method, budget, rho and lambdas from presto.json), the real
    target, judged by the replay on prompts of our own."""
    from presto_sd.app.bench.replay import replay_bench, replay_rows
    from presto_sd.app.bench.runner import BenchConfig, BenchPrompt
    from presto_sd.app.cli import build_parser
    from presto_sd.app.generate import encode_prompt
    from presto_sd.app.stack import Stack, generation_params
    from presto_sd.embedded.stack import build_embedded

    args = build_parser().parse_args(["generate", "x", "--max-new-tokens", "48"])
    built = build_embedded(device=torch.device("cpu"))
    stack = Stack(built.verifier, built.drafter, built.tokenizer)
    params = generation_params(args, built.verifier.eos_token_ids, stack.drafter_info)
    assert params.tree.rho is not None and params.tree.lambdas  # the fitted ones, from presto.json
    texts = ["What is the capital of France? Answer in one sentence.",
             "Write a Python function that returns the largest of three numbers.",
             "Tom has 3 boxes with 12 pencils each. He gives away 7 pencils. How many are left?"]
    prompts = [BenchPrompt("own", str(i), tuple(encode_prompt(built.tokenizer, t, chat=True)))
               for i, t in enumerate(texts)]
    config = BenchConfig((args.method,), (args.budget,), params, warmup=False)
    logs, _ = replay_bench(built.verifier, built.drafter, prompts, config, progress=False)
    (row,) = replay_rows(logs)
    assert row["tau"] >= DEFAULT_METHOD_FLOOR, row


def test_every_shipped_self_draft_file_matches_its_digest():
    """The self-speculative adapter (``--drafter self``) is guarded as the drafter is: it fails
    (never skips) on an edited, truncated or LFS-pointer file, or one left out."""
    from presto_sd.embedded.stack import DEFAULT_SELF_DRAFT
    from presto_sd.models.self_draft import CONFIG_FILE, WEIGHTS_FILE, SelfDraftAdapter

    want = json.loads((DEFAULT_SELF_DRAFT / DIGESTS_FILE).read_text())
    assert {CONFIG_FILE, WEIGHTS_FILE} <= set(want)
    assert file_digests(DEFAULT_SELF_DRAFT) == want
    assert SelfDraftAdapter.load(DEFAULT_SELF_DRAFT).config.block >= 1


# Well under what the shipped adapter reaches on these prompts (docs/self_speculative.md): an
# adapter that drafts nothing useful (tau ~1.0) cannot pass. Measured 2.14 (bf16, 2026-12-05).
SELF_MODE_FLOOR = 1.5


@pytest.mark.smollm2
def test_the_self_mode_still_accepts_with_the_shipped_adapter():
    """``--drafter self`` with the CLI's default method and budget, judged by the replay."""
    from presto_sd.app.bench.replay import replay_bench, replay_rows
    from presto_sd.app.bench.runner import BenchConfig, BenchPrompt
    from presto_sd.app.cli import build_parser
    from presto_sd.app.generate import encode_prompt
    from presto_sd.app.stack import generation_params
    from presto_sd.embedded.stack import build_embedded

    args = build_parser().parse_args(["generate", "x", "--max-new-tokens", "48", "--drafter", "self"])
    built = build_embedded(drafter="self", device=torch.device("cpu"))
    params = generation_params(args, built.verifier.eos_token_ids, built.drafter.info())
    texts = ["What is the capital of France? Answer in one sentence.",
             "Write a Python function that returns the largest of three numbers.",
             "Tom has 3 boxes with 12 pencils each. He gives away 7 pencils. How many are left?"]
    prompts = [BenchPrompt("own", str(i), tuple(encode_prompt(built.tokenizer, t, chat=True)))
               for i, t in enumerate(texts)]
    config = BenchConfig((f"self-{args.method}",), (args.budget,), params, warmup=False)
    logs, _ = replay_bench(built.verifier, None, prompts, config, progress=False, self_drafter=built.drafter)
    (row,) = replay_rows(logs)
    assert row["tau"] >= SELF_MODE_FLOOR, row
