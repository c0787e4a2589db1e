"""Load the in-process engines: the target as an ``HFVerifier``, the DFlash drafter, or both.

The one place engines are loaded from a target and a drafter directory: the embedded
stack (``build_embedded``), ``presto-sd serve verifier|drafter`` and the orchestrator's
in-process replicas all call these. What the drafter directory holds is read by
``presto_sd.models.assets``; whatever is there is loaded, the rest keeps its defaults.

``--drafter self`` (the shipped self-draft adapter) or ``self:DIR`` selects the
self-speculative mode (``self_drafter.py``): the verifier carries the adapter and the
drafter is a ``SelfDrafter``; it runs embedded (one process), where the verify forward's
drafts reach the tree builder without a wire.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from presto_sd.embedded.dflash_drafter import DFlashDrafter
from presto_sd.embedded.hf_verifier import WALK_ROWS, HFVerifier
from presto_sd.embedded.memory import kv_budget
from presto_sd.embedded.self_drafter import SELF_PREFIX, SelfDrafter
from presto_sd.engine.drafter import Drafter
from presto_sd.engine.verifier import VerifierLimits
from presto_sd.method.ngram import NGramModel
from presto_sd.method.scores import HPhi, LearnedRho, NGramRho, RhoProvider
from presto_sd.models.assets import DrafterAssets
from presto_sd.models.dflash import DFlashConfig
from presto_sd.models.invariant import native_bf16
from presto_sd.models.loading import (
    eos_token_ids,
    load_drafter_model,
    load_target,
    random_drafter_config,
    resolve_drafter,
    target_gguf,
)
from presto_sd.models.quant import (
    ROW_BLOCK,
    WEIGHTS,
    gguf_q4_1_blocks,
    gguf_q8_0_head,
    int4_linears,
    open_gguf,
)
from presto_sd.models.self_draft import SelfDraftAdapter

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
# the shipped self-draft adapter (``presto-sd train self-draft``; docs/self_speculative.md)
DEFAULT_SELF_DRAFT = Path(__file__).parents[1] / "assets" / "self_draft" / "smollm2-135m"
log = logging.getLogger("presto_sd.embedded")


@dataclass
class EmbeddedStack:
    verifier: HFVerifier
    drafter: Drafter  # a DFlashDrafter, or a SelfDrafter (self-speculative mode)
    tokenizer: PreTrainedTokenizerBase
    assets: DrafterAssets  # the drafter's directory, and the PRESTO settings fitted for it


def self_draft_dir(spec: str | None) -> Path | None:
    """The adapter dir ``--drafter self`` / ``self:DIR`` names; None for any other drafter."""
    if spec is None or not (spec == SELF_PREFIX or spec.startswith(SELF_PREFIX + ":")):
        return None
    path = Path(spec[len(SELF_PREFIX) + 1 :]).expanduser() if ":" in spec else DEFAULT_SELF_DRAFT
    if not path.is_dir():
        raise FileNotFoundError(f"--drafter {spec}: no adapter dir {path} (`presto-sd train self-draft` "
                                "makes one)")
    return path


def self_drafter_engine(verifier: HFVerifier, adapter_dir: Path, assets: DrafterAssets,
                        max_chains: int | None = None) -> SelfDrafter:
    """The drafter of the self-speculative mode over ``verifier`` (which carries the adapter);
    the n-gram table is the target's shipped one (its text, not a drafter's), if any."""
    table = assets.ngram_table
    return SelfDrafter(verifier.adapter.config.block, verifier.vocab_size, verifier.target_layer_ids,
                       NGramModel.load(table) if table is not None else None, max_chains,
                       name=f"{SELF_PREFIX}:{adapter_dir}")


def drafter_assets(target: str | None, drafter: str | None) -> DrafterAssets:
    """The drafter directory ``--drafter`` names for ``--target`` (the shipped one by default)."""
    if self_draft_dir(drafter) is not None:  # build_embedded reads it; the served engines do not
        raise ValueError(f"--drafter {drafter}: the self-speculative mode runs embedded (generate, bench), "
                         "not as served engines: its drafts come back inside the verify forward")
    return DrafterAssets.read(resolve_drafter(drafter, target).path)


def rho_providers_from(assets: DrafterAssets, embed_tokens: torch.Tensor) -> dict[str, RhoProvider]:
    providers: dict[str, RhoProvider] = {}
    if assets.path is None:
        return providers
    table = assets.ngram_table
    providers["ngram"] = NGramRho(NGramModel.load(table) if table is not None else None)
    if assets.h_phi_dir is not None:
        providers["hphi"] = LearnedRho(HPhi.load(assets.h_phi_dir), embed_tokens, providers["ngram"])
    return providers


def drafter_engine(model: PreTrainedModel, assets: DrafterAssets, max_sessions: int = 256) -> DFlashDrafter:
    """The drafter on ``model``'s embeddings and lm_head, its Info naming it and its defaults."""
    draft_model = load_drafter_model(assets, model)
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    return DFlashDrafter(draft_model, embed, head, rho_providers_from(assets, embed),
                         max_sessions=max_sessions, name=assets.name, defaults=assets.defaults)


def verifier_engine(
    model: PreTrainedModel, tok: PreTrainedTokenizerBase, target: str | None, assets: DrafterAssets,
    limits: VerifierLimits = VerifierLimits(), prefill_chunk: int = 512, decoder: str = "auto",
    weights: str = "dense", adapter: SelfDraftAdapter | None = None, compile: bool = False,
) -> HFVerifier:
    """The target emitting the features the drafter was trained on (its ``target_layer_ids``);
    ``weights`` "gguf-int4": its linears from the target GGUF's own Q4_1 blocks (``quant``);
    ``compile``: its AR steps' forwards through torch.compile (``models/compiled.py``; an
    experiment, not a CLI flag: docs/benchmarks.md says why)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r}: one of {', '.join(WEIGHTS)}")
    linears, head, walk_rows = None, None, WALK_ROWS
    if weights == "gguf-int4":
        reader = open_gguf(target_gguf(target))
        linears = int4_linears(gguf_q4_1_blocks(reader, model.config), model, model.dtype)
        head = gguf_q8_0_head(reader, model, model.dtype)
        walk_rows = ROW_BLOCK if head is not None else WALK_ROWS  # more rows: another kernel block
    config = assets.config or random_drafter_config(model.config)
    return HFVerifier(model, DFlashConfig.from_dict(config).target_layer_ids, limits,
                      eos_token_ids=eos_token_ids(model, tok), name=target or DEFAULT_TARGET_NAME,
                      prefill_chunk=prefill_chunk, decoder=decoder, linears=linears, adapter=adapter,
                      head=head, walk_rows=walk_rows, compile=compile, weights=weights)


def weights_dtype(weights: str, dtype: torch.dtype | None) -> torch.dtype | None:
    """The model dtype for ``weights``: the int4 kernel is fast with bf16 activations, so
    that is its default where the CPU has native bf16 (its rows are probed at load)."""
    if dtype is None and weights == "gguf-int4" and native_bf16():
        return torch.bfloat16
    return dtype


def _budget(engine: DFlashDrafter | HFVerifier, kind: str, device: torch.device,
            max_kv_gb: float | None) -> None:
    """Give a loaded engine its KV budget (``--max-kv-gb``, else the machine's share), and log it."""
    budget = kv_budget(device, max_kv_gb)
    engine.sessions.budget_bytes = budget.nbytes
    log.info(json.dumps({"event": "kv_budget", "engine": kind, "budget_bytes": budget.nbytes,
                         "bytes_per_token": engine.sessions.bytes_per_token, "rule": budget.rule}))


def load_drafter(target: str | None, drafter: str | None, max_sessions: int = 256,
                 dtype: torch.dtype | None = None, max_kv_gb: float | None = None) -> DFlashDrafter:
    """The drafter alone: the target's embeddings and lm_head, the rest of the target dropped.

    Its sessions' K/V get a budget: ``max_kv_gb``, else a share of the free memory (``memory``).
    """
    assets = drafter_assets(target, drafter)  # a --drafter that cannot be had fails before the load
    model, _ = load_target(target, dtype=dtype)
    engine = drafter_engine(model, assets, max_sessions)
    del model
    _budget(engine, "drafter", engine.lm_head.device, max_kv_gb)
    return engine


def load_verifier(target: str | None, drafter: str | None, max_sessions: int = VerifierLimits.max_sessions,
                  dtype: torch.dtype | None = None, max_kv_gb: float | None = None,
                  prefill_chunk: int = 512, decoder: str = "auto", weights: str = "dense") -> HFVerifier:
    """The target alone, its cost model calibrated (a few seconds of forwards) for TAPS, its
    sessions' KV given a budget (``max_kv_gb``, else a share of the free memory: ``memory``)."""
    assets = drafter_assets(target, drafter)
    model, tok = load_target(target, dtype=weights_dtype(weights, dtype))
    verifier = verifier_engine(model, tok, target, assets, VerifierLimits(max_sessions=max_sessions),
                               prefill_chunk, decoder, weights)
    verifier.calibrate_cost()  # TAPS's cost model, in Info from the first call on
    _budget(verifier, "verifier", verifier.device, max_kv_gb)
    return verifier


def build_embedded(
    target: str | None = None,
    drafter: str | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    decoder: str = "auto",
    weights: str = "dense",
    self_draft: str | None = None,
    self_chains: int | None = None,
) -> EmbeddedStack:
    """Verifier and drafter in this process, sharing one copy of the target. ``drafter``
    ``self`` / ``self:DIR``: the self-speculative mode (``self_chains``: its chains per
    forward, None after every node). ``self_draft`` (a dir): the adapter on the verifier
    beside a DFlash drafter (the bench runs both modes on one target)."""
    self_mode = self_draft_dir(drafter)  # the drafter is the target itself
    assets = drafter_assets(target, None if self_mode is not None else drafter)
    model, tok = load_target(target, device, weights_dtype(weights, dtype))
    adapter_dir = self_mode or (Path(self_draft) if self_draft else None)
    adapter = None
    if adapter_dir is not None:
        adapter = SelfDraftAdapter.load(adapter_dir, model.dtype).to(model.device)
    verifier = verifier_engine(model, tok, target, assets, decoder=decoder, weights=weights, adapter=adapter)
    if self_mode is not None:
        return EmbeddedStack(verifier, self_drafter_engine(verifier, adapter_dir, assets, self_chains), tok,
                             assets)
    return EmbeddedStack(verifier, drafter_engine(model, assets), tok, assets)
