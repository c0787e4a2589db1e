"""``TargetRunner``: the target's forward over sessions' KV pages, and its lm_head.

What runs a forward, apart from who asks for it: the decoder (the owned Llama-family one of
``models/llama.py`` where it runs, else transformers' with a packed mask), the row-invariant
kernels of its linears and head, the decode rows' attention kernel, and which layers' hidden
states leave it as features. It holds no sessions and admits nothing: ``HFVerifier`` owns the
sessions, their KV budget and the walks, and calls ``forward`` / ``logits`` here.

Every forward is one packed sequence of new tokens (a prompt chunk, one tree, or many
sessions' trees and AR steps together) whose attention runs per session over that session's
own KV, written in place (``models/session_kv.py``, ``models/packed.py``).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence

import torch
from transformers import PreTrainedModel

from presto_sd.method.tree import TokenTree
from presto_sd.models import llama
from presto_sd.models.invariant import (
    attention_shape,
    install_invariant_linears,
    invariant_linear,
    key_width,
    pick_attention_kernel,
    pick_linear_kernel,
)
from presto_sd.models.llama import Linear
from presto_sd.models.packed import Segment, packed_forward, packed_plan
from presto_sd.models.self_draft import SelfDraftAdapter
from presto_sd.models.session_kv import SessionKV

DECODERS = ("auto", "owned", "transformers")
# a decoded chain's forward gathers each row's keys: rows x key width stays under this
CHAIN_KEYS = 1 << 16


class TargetRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        target_layer_ids: Sequence[int],
        decoder: str = "auto",  # "owned" (models/llama.py), "transformers", or "auto": owned where it runs
        linears: Mapping[str, Linear] | None = None,  # row-invariant kernels for the owned decoder's linears
        adapter: SelfDraftAdapter | None = None,  # self-speculative mask rows (needs the owned decoder)
        head: Linear | None = None,  # a row-invariant lm_head kernel (fp32 logits): the GGUF's Q8_0
        compile: bool = False,  # the owned decoder's AR steps through torch.compile (models/compiled.py)
    ) -> None:
        if decoder not in DECODERS:
            raise ValueError(f"decoder {decoder!r}: one of {', '.join(DECODERS)}")
        n_layers = model.config.num_hidden_layers
        if not target_layer_ids or not all(0 <= i < n_layers for i in target_layer_ids):
            raise ValueError(f"target_layer_ids {tuple(target_layer_ids)} out of range [0, {n_layers})")
        self.model = model.eval()
        self.target_layer_ids = tuple(int(i) for i in target_layer_ids)
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        # row-invariant kernels inside the packed forward only: a tree's rows are bitwise AR's steps
        w = self.head_weight = self.lm_head.weight
        self.head = head
        if head is not None:  # probed row-invariant by its maker (quant.gguf_q8_0_head)
            self.head_kernel: str | None = "given"
        else:
            self.head_kernel = pick_linear_kernel(w.shape[1], w.shape[0], w.dtype, w.device.type)
        if self.head_kernel is None and w.dtype != torch.float32:
            # no invariant kernel in the model's dtype (bf16 on Intel AMX): the head in fp32, on a
            # copy of its weight, where oneDNN's rows agree; the logits are fp32 either way
            fp32 = pick_linear_kernel(w.shape[1], w.shape[0], torch.float32, w.device.type)
            if fp32 is not None:
                self.head_weight, self.head_kernel = w.detach().float(), fp32
        linears_ok = install_invariant_linears(self.decoder)
        owned = decoder == "owned" or (decoder == "auto" and llama.supports(model))
        if linears and not owned:
            raise ValueError(f"linears replace the owned decoder's: decoder {decoder!r} does not run it here")
        if adapter is not None and not owned:
            raise ValueError(f"a self-draft adapter runs in the owned decoder: decoder {decoder!r} does not")
        if compile and not owned:
            raise ValueError(f"compile runs the owned decoder: decoder {decoder!r} does not run it here")
        # given linears are probed row-invariant by their maker (quant.int4_linears)
        self.row_invariant = (bool(linears) or linears_ok) and self.head_kernel is not None
        # None: transformers' forward
        self.owned = llama.LlamaDecoder(model, linears, adapter, compile) if owned else None
        # the decode rows' attention: torch's fused kernel where its rows agree (bf16 here)
        self.attention_kernel = pick_attention_kernel(*attention_shape(model.config), model.dtype,
                                                      self.head_weight.device.type)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(
        self, segments: list[Segment], input_ids: list[int], positions: Sequence[int] | torch.Tensor,
        mask_rows: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One packed forward of every segment's new tokens: final hidden states [N, H] and
        target-layer features [N, F]. Each session's KV receives its new entries after its
        committed length (``SessionKV.keep`` commits them). ``mask_rows``: the self-draft
        rows (``MaskChains``), computed by the adapter (owned decoder only)."""
        positions = torch.as_tensor(positions, dtype=torch.long)
        if self.owned is not None:
            plan = packed_plan(segments, self.device, self.attention_kernel)
            ids = torch.tensor(input_ids, device=self.device)
            masks = torch.tensor(mask_rows, dtype=torch.long, device=self.device) if mask_rows else None
            last, kept = self.owned.forward(ids, positions.to(self.device), plan, self.target_layer_ids,
                                            mask_rows=masks)
            return last, torch.cat(kept, dim=-1)
        with packed_forward(self.model, segments, self.attention_kernel):
            out = self.decoder(
                input_ids=torch.tensor([input_ids], device=self.device),
                position_ids=positions[None].to(self.device),
                use_cache=False,
                output_hidden_states=True,
            )
        feats = torch.cat([out.hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)
        return out.last_hidden_state[0], feats[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head over hidden states ``[..., H]`` -> fp32 logits, through the row-invariant
        kernel every walk uses (the replay reads them as a round would)."""
        if self.head is not None:
            return self.head(hidden)
        w, bias = self.head_weight, self.lm_head.bias
        bias = None if bias is None else bias.to(w.dtype)
        return invariant_linear(hidden.to(w.dtype), w, bias, self.head_kernel or "aten").float()

    def prefill_chunks(self, kv: SessionKV, token_ids: Sequence[int], chunk: int,
                       decoded: int = 0) -> Generator[tuple[torch.Tensor, torch.Tensor, int]]:
        """A prompt's forward ``chunk`` tokens at a time, each after the positions the earlier
        ones committed (as AR decoding builds them): yields each piece's (final hidden
        states, features, tokens done), its KV committed. The last ``decoded`` tokens (a
        session's output, fed again) go as chains, each node the row its AR step computed
        (``decode_chain``), not as a chunk: a chunk's attention rounds its own way."""
        token_ids = list(token_ids)
        prompt = len(token_ids) - decoded
        for start in range(0, prompt, chunk):
            ids = token_ids[start : min(start + chunk, prompt)]
            hidden, f = self.forward([Segment(kv, 0, len(ids))], ids, range(start, start + len(ids)))
            kv.keep(range(len(ids)))
            yield hidden, f, start + len(ids)
        yield from self.decoded_chains(kv, token_ids, prompt, chunk)

    def decoded_chains(self, kv: SessionKV, token_ids: Sequence[int], start: int,
                       chunk: int) -> Generator[tuple[torch.Tensor, torch.Tensor, int]]:
        """``token_ids[start:]`` (a session's decoded output; ``kv`` holds the ``start`` before
        them) as chains of up to ``chunk`` rows (``decode_chain``): yields as ``prefill_chunks``."""
        while start < len(token_ids):
            n = min(chunk, len(token_ids) - start)
            while n > 1 and n * key_width(start + n) > CHAIN_KEYS:  # its gathered keys stay small
                n //= 2
            hidden, f = self.decode_chain(kv, token_ids[start : start + n])
            start += n
            yield hidden, f, start

    def decode_chain(self, kv: SessionKV, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_ids`` after ``kv``'s committed positions, as one tree that is a chain: every
        row bitwise the AR step that computes it (the tree rows' contract), committed."""
        n, length = len(token_ids), kv.length
        paths = tuple(tuple(range(i + 1)) for i in range(n))
        hidden, f = self.forward([Segment(kv, 0, n, paths)], list(token_ids), range(length, length + n))
        kv.keep(range(n))
        return hidden, f

    def next_token_logits(self, kv: SessionKV, prompt: Sequence[int],
                          continuations: Sequence[Sequence[int]], chunk: int) -> torch.Tensor:
        """fp32 logits ``[B, V]`` of the token after ``prompt + c`` for each continuation ``c``,
        on ``kv`` (a fresh session's: nothing of it is kept), bitwise what AR computes there
        after a prefill in chunks of ``chunk``: the prompt's last row from the prefill's
        forward, a continuation's from a tree over the prompt's KV (tree rows are AR steps'
        rows: that is what makes every method lossless)."""
        if not prompt:
            raise ValueError("next_token_logits: an empty prompt (the law starts after a prefill)")
        for hidden, _, _ in self.prefill_chunks(kv, prompt, chunk):
            last = hidden[-1]
        vocab = self.model.config.vocab_size
        out = torch.empty(len(continuations), vocab, dtype=torch.float32, device=self.device)
        by_first: dict[int, list[int]] = {}
        for i, c in enumerate(continuations):
            if c:
                by_first.setdefault(c[0], []).append(i)
            else:
                out[i] = self.logits(last)
        for group in by_first.values():  # one tree per first token, written over the same free KV
            node_of: dict[tuple[int, ...], int] = {}
            tokens, parents = [], []
            for i in group:
                c = tuple(continuations[i])
                for d in range(1, len(c) + 1):
                    if c[:d] not in node_of:
                        node_of[c[:d]] = len(tokens)
                        tokens.append(c[d - 1])
                        parents.append(node_of[c[: d - 1]] if d > 1 else -1)
            tree = TokenTree.from_lists(tokens, parents)
            rows, _ = self.forward([Segment(kv, 0, len(tokens), tree.paths())], tokens,
                                   tree.position_ids(len(prompt)))
            out[group] = self.logits(rows[[node_of[tuple(continuations[i])] for i in group]])
        return out
