"""`--dtype` and `--decoder` reach the engines they name: embedded, `serve verifier`, and the
orchestrator's in-process replicas (which once loaded every replica at the default dtype)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from orchestrator.actors import local_spec
from presto_sd.app.cli import build_parser
from presto_sd.embedded.stack import build_embedded


@pytest.mark.parametrize("decoder, owned", [("owned", True), ("transformers", False), ("auto", True)])
def test_build_embedded_takes_the_decoder(tiny_target_dir, decoder, owned):
    stack = build_embedded(str(tiny_target_dir), "random", dtype=torch.float32, decoder=decoder)
    assert (stack.verifier.runner.owned is not None) is owned
    assert stack.verifier.info().decoder == ("owned" if owned else "transformers")


def test_an_unknown_decoder_is_refused(tiny_target_dir):
    with pytest.raises(ValueError, match="decoder 'fast'"):
        build_embedded(str(tiny_target_dir), "random", dtype=torch.float32, decoder="fast")


def test_local_replicas_load_the_dtype_and_decoder_given(tiny_target_dir):
    verifier = local_spec("verifier", 0, str(tiny_target_dir), "random", dtype="float32",
                          decoder="transformers").factory()
    assert verifier.model.dtype == torch.float32 and verifier.runner.owned is None
    drafter = local_spec("drafter", 0, str(tiny_target_dir), "random", dtype="float32").factory()
    assert drafter.lm_head.dtype == torch.float32


@pytest.mark.parametrize("argv", [["generate", "hi"], ["bench"], ["serve", "verifier", "--port", "0"],
                                  ["serve", "orchestrator", "--port", "0"], ["up"]])
def test_every_command_that_loads_a_verifier_has_the_decoder_flag(argv):
    args = build_parser().parse_args([*argv, "--decoder", "transformers"])
    assert args.decoder == "transformers"


def test_the_drafter_server_has_no_decoder_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "drafter", "--port", "0", "--decoder", "owned"])
    assert "unrecognized arguments: --decoder" in capsys.readouterr().err


def test_generate_refuses_the_decoder_for_remote_engines():
    r = subprocess.run([sys.executable, "-m", "presto_sd.app.cli", "generate", "hi", "--verifier-addr",
                        "127.0.0.1:1", "--decoder", "owned"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--decoder sets embedded engines" in r.stderr


def test_drafter_self_builds_the_self_speculative_stack(tiny_target_dir, tmp_path):
    """``--drafter self:DIR``: the verifier carries DIR's adapter, the drafter is a SelfDrafter,
    and a generation through it is the AR one (``--self-chains`` reaches the drafter)."""
    from presto_sd.embedded.self_drafter import SelfDrafter
    from presto_sd.loop.generate import GenerationParams, generate
    from presto_sd.models.self_draft import SelfDraftAdapter

    model = build_embedded(str(tiny_target_dir), "random", dtype=torch.float32).verifier.model
    SelfDraftAdapter.for_model(model, block=3, rank=2).save(tmp_path / "adapter")
    stack = build_embedded(str(tiny_target_dir), f"self:{tmp_path / 'adapter'}", dtype=torch.float32,
                           self_chains=2)
    assert isinstance(stack.drafter, SelfDrafter) and stack.drafter.max_chains == 2
    assert stack.verifier.info().self_draft_block == 3
    prompt = stack.tokenizer("Hello there")["input_ids"]
    ar = generate(stack.verifier, None, prompt, GenerationParams(method="ar", max_new_tokens=12))
    out = generate(stack.verifier, stack.drafter, prompt, GenerationParams(max_new_tokens=12))
    assert out.token_ids == ar.token_ids
