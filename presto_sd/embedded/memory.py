"""What a session's KV costs, and the KV budget an engine gets by default.

A cached position costs ``2 (K and V) x layers x kv_heads x head_dim x dtype bytes`` on
either engine: the verifier's cache over every target layer, the drafter's context K/V
over its own layers. Neither engine keeps feature rows (the verifier returns them, the
drafter turns them into context K/V at once). The default budget is a fixed share of the
memory the engine's device has free once the model is loaded: ``KV_SHARE`` of
``MemAvailable`` (``/proc/meminfo``) on a CPU, of ``torch.cuda.mem_get_info`` on a GPU.
The rest is headroom for the forwards' working memory and the process itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

KV_SHARE = 0.4  # of the memory free after loading; the verifier and drafter of `up` share a host


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


def target_kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """A transformers config's cost of one cached position (every layer is a full one here:
    the verifier keeps plain dynamic layers)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_bytes_per_token(config.num_hidden_layers, kv_heads, head_dim, dtype)


@dataclass(frozen=True)
class KVBudget:
    nbytes: int
    rule: str  # how it was chosen, for the start-up log


def free_memory(device: torch.device) -> tuple[int, str]:
    """Bytes free on ``device`` now, and where that number comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory of {device}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages"


def kv_budget(device: torch.device, max_kv_gb: float | None) -> KVBudget:
    """``--max-kv-gb`` when given, else ``KV_SHARE`` of what ``device`` has free."""
    if max_kv_gb is not None:
        if max_kv_gb <= 0:
            raise ValueError(f"--max-kv-gb {max_kv_gb}: must be > 0")
        return KVBudget(int(max_kv_gb * 1e9), f"--max-kv-gb {max_kv_gb:g}")
    free, source = free_memory(device)
    return KVBudget(int(KV_SHARE * free), f"{KV_SHARE:.0%} of {source} ({free / 1e9:.2f} GB) after loading")
