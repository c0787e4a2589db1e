"""Build the embedded stack: target verifier + DFlash drafter in one process.

A drafter directory may carry PRESTO assets beside the DFlash checkpoint:
``ngram.json.gz`` (an n-gram table from target-generated text), ``h_phi/`` (the learned
acceptance predictor) and ``presto.json`` (``{"lambdas": [...], "rho": "..."}`` fitted
on held-out traces). Whatever is there is loaded; the rest keeps its defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from presto_sd.embedded.dflash_drafter import DFlashDrafter
from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.method.ngram import NGramModel
from presto_sd.method.scores import HPhi, LearnedRho, NGramRho, RhoProvider
from presto_sd.models.loading import (
    DrafterSpec,
    eos_token_ids,
    load_drafter_model,
    load_target,
    read_json,
    resolve_drafter,
)


@dataclass
class EmbeddedStack:
    verifier: HFVerifier
    drafter: DFlashDrafter
    tokenizer: PreTrainedTokenizerBase
    drafter_spec: DrafterSpec
    presto_defaults: dict  # lambdas / rho fitted for this drafter, if shipped


def rho_providers_from(drafter_dir: Path | None, embed_tokens: torch.Tensor) -> dict[str, RhoProvider]:
    providers: dict[str, RhoProvider] = {}
    if drafter_dir is None:
        return providers
    table = drafter_dir / "ngram.json.gz"
    providers["ngram"] = NGramRho(NGramModel.load(table) if table.exists() else None)
    if (drafter_dir / "h_phi" / "h_phi.json").exists():
        providers["hphi"] = LearnedRho(HPhi.load(drafter_dir / "h_phi"), embed_tokens, providers["ngram"])
    return providers


def build_embedded(
    target: str | None = None,
    drafter: str | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> EmbeddedStack:
    model, tok = load_target(target, device, dtype)
    spec = resolve_drafter(drafter, target)
    draft_model = load_drafter_model(spec, model)
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    verifier = HFVerifier(
        model, draft_model.config.target_layer_ids, eos_token_ids=eos_token_ids(model, tok),
        name=target or "SmolLM2-135M-Instruct",
    )
    drafter_engine = DFlashDrafter(draft_model, embed, head, rho_providers_from(spec.path, embed))
    presto = {}
    if spec.path is not None and (spec.path / "presto.json").exists():
        presto = read_json(spec.path / "presto.json")
    return EmbeddedStack(verifier, drafter_engine, tok, spec, presto)
