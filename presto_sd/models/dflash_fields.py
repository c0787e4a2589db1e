"""Which fields of a published DFlash ``config.json`` this implementation honours.

``DFlashConfig.from_dict`` reads the architecture fields (sizes, heads, ``head_dim``,
``rms_norm_eps``, ``attention_bias``, default RoPE with its theta, ``block_size``,
``dflash_config: {mask_token_id, target_layer_ids}``). A field that would change what
the model computes, and that it does not implement, is refused here with the field named
(``UnsupportedDrafterConfig``), never silently ignored:

- an architecture other than ``DFlashDraftModel`` (``DFlash2DraftModel`` adds convolutions
  and a candidate selector);
- a non-silu activation (``hidden_act``);
- sliding-window layers (``layer_types`` holding ``sliding_attention``, or Qwen3's
  ``use_sliding_window`` over ``max_window_layers``), and causal block attention
  (``is_causal: true``): the published code makes sliding layers causal too;
- logit softcapping (``final_logit_softcapping``, ``attn_logit_softcapping``);
- input and output scaling (``input_embedding_scale``, ``output_multiplier``, and the
  ``*_multiplier`` / ``scale_*`` fields of other families) other than 1;
- RoPE scaling other than ``default``, a partial rotary factor, and any ``dflash_config``
  key this implementation does not read.

Fields with no effect on a drafter's forward (``bos/eos/pad_token_id``, ``dtype``,
``initializer_range``, ``attention_dropout``, ``use_cache``, ``tie_word_embeddings``,
``auto_map``, ``transformers_version``, ``max_position_embeddings``) are accepted as is.
docs/design.md §2 keeps the same list for users.
"""

from __future__ import annotations

ARCHITECTURE = "DFlashDraftModel"
# the dflash_config keys DFlashConfig reads (prefix_head_rank / draft_vocab_size: this
# project's own extensions, written by `presto-sd train drafter`)
DFLASH_KEYS = frozenset({"block_size", "mask_token_id", "target_layer_ids", "draft_vocab_size",
                         "prefix_head_rank"})
# published DFlash knobs read from dflash_config or the top level: only their neutral value is
# implemented (the z-lab code reads each from either place)
NEUTRAL = {"input_embedding_scale": 1.0, "output_multiplier": 1.0}
SOFTCAPS = ("final_logit_softcapping", "attn_logit_softcapping")
# scaling fields of other model families, refused unless neutral
OTHER_SCALES = ("embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier",
                "scale_emb", "scale_depth", "partial_rotary_factor")


class UnsupportedDrafterConfig(ValueError):
    """A drafter config asks for something this implementation does not compute."""


def check_supported(d: dict) -> None:
    """Refuse (``UnsupportedDrafterConfig``, naming the field) what the model would get wrong."""
    dflash = d.get("dflash_config") or {}
    arch = d.get("architectures")
    if arch is not None and list(arch) != [ARCHITECTURE]:
        _refuse(f"architectures = {arch}: only {ARCHITECTURE} is implemented")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        _refuse(f"hidden_act = {act!r}: only silu is implemented")
    for i, kind in enumerate(layer_types(d)):
        if kind != "full_attention":
            _refuse(f"layer {i} is {kind!r} (layer_types / use_sliding_window): only full attention "
                    "over the context and the block is implemented")
    if d.get("is_causal"):
        _refuse("is_causal = true: the block attends to itself bidirectionally here")
    for key in SOFTCAPS:
        for where, value in (("", d.get(key)), ("dflash_config.", dflash.get(key))):
            if value is not None and float(value) > 0:
                _refuse(f"{where}{key} = {value}: logit softcapping is not implemented")
    for key, neutral in NEUTRAL.items():
        for where, value in (("", d.get(key)), ("dflash_config.", dflash.get(key))):
            if value is not None and float(value) != neutral:
                _refuse(f"{where}{key} = {value}: only {neutral} is implemented")
    for key in OTHER_SCALES:
        if d.get(key) is not None and float(d[key]) != 1.0:
            _refuse(f"{key} = {d[key]}: only 1 is implemented")
    unknown = sorted(set(dflash) - DFLASH_KEYS - set(NEUTRAL) - set(SOFTCAPS))
    if unknown:
        _refuse(f"dflash_config.{unknown[0]}: not a field this implementation reads "
                f"(it reads {', '.join(sorted(DFLASH_KEYS))})")


def layer_types(d: dict) -> list[str]:
    """Each layer's attention kind: ``layer_types``, else as Qwen3's config derives it."""
    n = int(d.get("num_hidden_layers", 0))
    if d.get("layer_types") is not None:
        return list(d["layer_types"])
    sliding = d.get("sliding_window") if d.get("use_sliding_window") else None
    first = d.get("max_window_layers")
    first = 28 if first is None else int(first)  # Qwen3Config's default
    return ["sliding_attention" if sliding is not None and i >= first else "full_attention" for i in range(n)]


def _refuse(what: str) -> None:
    raise UnsupportedDrafterConfig(f"drafter config: {what}")
