"""``HFVerifier``: the target as any transformers causal LM, verifying trees in one forward.

The verifier owns the sessions (their tokens, generators and KV slots, admitted against a
byte budget), checks every call, and walks each tree after the forward; the forward itself
(decoder, kernels, lm_head) is ``TargetRunner``'s (``target_runner.py``). A tree node sees
the committed prefix and its own ancestors, at position ``base + depth``. After the walk the
session keeps exactly the accepted path, which equals the KV that AR decoding of the same
tokens produces (tests hold this).

A long prompt is prefilled in chunks of ``prefill_chunk`` tokens; ``prefill_steps`` yields
between chunks, so a server runs other sessions' calls in between. KV bytes are admitted
against the session table's budget before a forward allocates them.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from presto_sd.embedded.cost_calibration import calibrate_verify_cost
from presto_sd.embedded.memory import target_kv_bytes_per_token
from presto_sd.embedded.target_runner import TargetRunner
from presto_sd.engine.calls import Prefill
from presto_sd.engine.messages import (
    EngineError,
    FeatureDelta,
    LimitExceededError,
    answer_of,
    check_once_per_batch,
)
from presto_sd.engine.sessions import Seat, SessionTable
from presto_sd.engine.verifier import (
    BatchAnswer,
    BatchCall,
    MaskChains,
    PrefillCall,
    PrefillResult,
    Verifier,
    VerifierInfo,
    VerifierLimits,
    VerifyCall,
    VerifyResult,
    call_rows,
    check_prompt,
    check_verify_call,
    fit_chains,
)
from presto_sd.method.acceptance import (
    SamplingParams,
    WalkResult,
    node_token_probs,
    sample_token,
    walk_tree,
)
from presto_sd.method.cost_model import CostFit, OnlineCostModel
from presto_sd.method.scores import DraftMarginals
from presto_sd.method.tree import TokenTree
from presto_sd.models.invariant import KEY_BLOCK, MAX_INVARIANT_ROWS
from presto_sd.models.llama import Linear
from presto_sd.models.packed import Segment
from presto_sd.models.self_draft import SelfDraftAdapter
from presto_sd.models.session_kv import KVStore, SessionKV

# trees up to this many nodes get every node's logits in the forward's one lm_head matmul
# (a 2-vCPU bf16 head: 4.4 ms for 2 rows, 6.6 ms for 16: cheaper than tau >= 2 rows one by one)
WALK_ROWS = 32


@dataclass
class _Session:
    kv: SessionKV
    tokens: list[int]  # committed tokens; the last one is the pending anchor
    sampling: SamplingParams
    generator: torch.Generator
    last_used: float = field(default_factory=time.monotonic)

    @property
    def base(self) -> int:
        return len(self.tokens) - 1

    @property
    def positions(self) -> int:  # KV positions cached: every committed token but the anchor
        return self.base


class HFVerifier(Verifier):
    def __init__(
        self,
        model: PreTrainedModel,
        target_layer_ids: tuple[int, ...] | list[int],
        limits: VerifierLimits = VerifierLimits(),
        eos_token_ids: tuple[int, ...] = (),
        name: str = "",
        max_kv_bytes: int | None = None,  # the sessions' KV budget (None: no budget)
        prefill_chunk: int = 512,  # tokens per prefill forward
        kv_min_capacity: int = 256,  # a session's smallest KV slot (positions); classes double from it
        decoder: str = "auto",  # "owned" (models/llama.py), "transformers", or "auto": owned where it runs
        linears: Mapping[str, Linear] | None = None,  # row-invariant kernels for the owned decoder's linears
        adapter: SelfDraftAdapter | None = None,  # self-speculative mask rows (needs the owned decoder)
        head: Linear | None = None,  # a row-invariant lm_head kernel (fp32 logits): the GGUF's Q8_0
        walk_rows: int = WALK_ROWS,  # a tree's nodes whose logits come in one head matmul
        compile: bool = False,  # the owned decoder's AR steps through torch.compile (models/compiled.py)
        weights: str = "dense",  # what ``linears`` / ``head`` are, for info(): "dense" or "gguf-int4"
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk {prefill_chunk}: must be >= 1")
        self.runner = TargetRunner(model, target_layer_ids, decoder, linears, adapter, head, compile)
        self.model = self.runner.model
        self.target_layer_ids = self.runner.target_layer_ids
        self.adapter = adapter
        # the mask chains' deepest block (0: no adapter, no chains)
        self.self_draft_block = adapter.config.block if adapter is not None else 0
        self.walk_rows = walk_rows
        self.weights = weights
        self.vocab_size = model.config.vocab_size
        self.limits = VerifierLimits(
            max_sessions=limits.max_sessions,
            max_context=_max_context(model.config, limits.max_context),
            tree=type(limits.tree)(
                limits.tree.max_nodes, limits.tree.max_depth, self.vocab_size
            ),
        )
        self.eos_token_ids = tuple(eos_token_ids)
        self.name = name or model.config.name_or_path
        self.prefill_chunk = prefill_chunk
        # sessions' KV as slots of shared pages: one attention call reads many AR steps in place
        self.kv_store = KVStore.for_model(model, min_capacity=kv_min_capacity)
        # the budget counts what the pages really hold (slots of a capacity class, page slack)
        self.sessions: SessionTable[_Session] = SessionTable(
            "verifier", self.limits.max_sessions, target_kv_bytes_per_token(model.config, model.dtype),
            max_kv_bytes, held_bytes=lambda: self.kv_store.nbytes,
        )
        self._seated: dict[int, int] = {}  # seat number -> entries its prompt will hold
        # one position's feature row: the response size of a prefill or verify follows from it
        self.feature_row_bytes = len(self.target_layer_ids) * model.config.hidden_size * model.dtype.itemsize
        # TAPS's c(B): None until calibrate_cost(), then refined by every tree forward
        self.forward_costs = OnlineCostModel()
        if compile:
            self.warm_compiled()

    @property
    def device(self) -> torch.device:
        return self.model.device

    def info(self) -> VerifierInfo:
        return VerifierInfo(
            model=self.name,
            dtype=str(self.model.dtype).removeprefix("torch."),
            device=str(self.device),
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            target_layer_ids=self.target_layer_ids,
            limits=self.limits,
            cost=self.forward_costs.fit,
            memory=self.sessions.memory(),
            row_invariant=self.runner.row_invariant,
            self_draft_block=self.self_draft_block,
            decoder="owned" if self.runner.owned is not None else "transformers",
            weights=self.weights,
            attention_kernel=self.runner.attention_kernel,
            prefill_chunk=self.prefill_chunk,
        )

    def warm_compiled(self) -> None:
        """Compile the AR-step graphs now (``compile``) on scratch sessions, so that no
        generation waits on the compiler. A graph is specialized where a size is 1 and where
        a key width fills its KV slot (the view is the whole slot), so each of: a lone step
        on a page of one slot, with its keys inside the slot and filling it; the same on a
        page of several slots; two sessions' steps in one forward. (Inductor caches them on
        disk: later loads are quicker.)"""
        full = min(self.kv_store.min_capacity, self.limits.max_context) - 2  # a step fills the slot
        sizes = {"a": KEY_BLOCK // 2, "full": full, "b": KEY_BLOCK // 2}
        ids = {name: f"presto-sd:warm-compile:{name}" for name in sizes}

        def prefill(name: str) -> None:
            self.prefill(ids[name], [0] * sizes[name])

        def step(*names: str) -> None:
            calls = [VerifyCall(ids[n], self.sessions[ids[n]].base,
                                TokenTree.root_only(self.sessions[ids[n]].tokens[-1])) for n in names]
            self.verify_batch(calls)

        try:
            prefill("a"), step("a"), self.close(ids["a"])  # a page of one slot
            prefill("full"), step("full")
            prefill("a"), step("a"), step("full")  # two slots
            prefill("b"), step("a", "b")
        finally:
            for sid in ids.values():
                if sid in self.sessions:
                    self.close(sid)

    def calibrate_cost(self) -> CostFit:
        """Time forwards over tree sizes and contexts; later forwards refine the fit."""
        fit = calibrate_verify_cost(self)
        self.forward_costs = OnlineCostModel(prior=fit)
        return fit

    # -- sessions -----------------------------------------------------------------------
    def close(self, session_id: str) -> None:
        self.sessions.close(session_id)

    def close_idle(self, ttl_s: float) -> list[str]:
        return self.sessions.close_idle(ttl_s)

    @torch.inference_mode()
    def next_token_logits(self, prompt: Sequence[int],
                          continuations: Sequence[Sequence[int]]) -> torch.Tensor:
        """fp32 logits ``[B, V]`` of the token after ``prompt + c`` for each continuation ``c``,
        bitwise what this engine's AR computes there after prefilling ``prompt``: the prompt's
        last row from the prefill's forward, a continuation's from a tree over the prompt's
        KV (its rows are AR steps' rows: that is what makes every method lossless). No
        session, nothing kept, no admission: exact sampling laws (tests) and scoring."""
        return self.runner.next_token_logits(self.kv_store.session(), prompt, continuations,
                                             self.prefill_chunk)

    def prefill(
        self,
        session_id: str,
        token_ids: list[int],
        sampling: SamplingParams = SamplingParams(),
        anchor: int | None = None,
        restart: bool = False,
        decoded: int = 0,
    ) -> PrefillResult:
        steps = self.prefill_steps(session_id, token_ids, sampling, anchor, restart, decoded)
        while True:  # every chunk at once
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    @torch.inference_mode()
    def prefill_steps(
        self,
        session_id: str,
        token_ids: list[int],
        sampling: SamplingParams = SamplingParams(),
        anchor: int | None = None,
        restart: bool = False,
        decoded: int = 0,
    ) -> Generator[None, None, PrefillResult]:
        """``prefill``, one chunk a step: it yields between chunks and returns the result.

        Checks and the seat (session cap, KV budget, ALREADY_EXISTS) come before the first
        forward; the session opens only after the last chunk, so a generator closed early
        (a deadline, a cancelled call) leaves the table as it was.
        """
        check_prompt(token_ids, anchor, self.vocab_size, self.limits.max_context, decoded)
        seat = self._seat(session_id, len(token_ids), restart)
        try:
            kv, feats = self.kv_store.session(), []
            kv.reserve(len(token_ids))  # the slot its seat paid for, at once (not grown chunk by chunk)
            for hidden, f, done in self.runner.prefill_chunks(kv, token_ids, self.prefill_chunk, decoded):
                last = hidden[-1]
                feats.append(f)
                if done < len(token_ids):
                    yield  # between chunks: the engine may run other sessions' calls
            call = PrefillCall(session_id, tuple(token_ids), sampling, anchor, restart, decoded)
            session, result = self._new_session(call, kv, self.runner.logits(last),
                                                torch.cat(feats) if len(feats) > 1 else feats[0])
            self.sessions.open(seat, session)
        finally:
            self._unseat(seat)
        return result

    # -- KV admission: by the bytes the store would allocate ------------------------------
    def _placement_cost(self, pending: list[int], n: int) -> int:
        """Bytes a new slot of ``n`` entries adds, after the slots ``pending`` will take."""
        store = self.kv_store
        return store.placement_bytes([*pending, n]) - store.placement_bytes(pending)

    def _seat(self, session_id: str, n_tokens: int, restart: bool, pending: Sequence[int] = ()) -> Seat:
        cost = self._placement_cost([*self._seated.values(), *pending], n_tokens)
        seat = self.sessions.seat(session_id, cost, restart, f"a prefill of {n_tokens} tokens")
        self._seated[seat.number] = n_tokens
        return seat

    def _unseat(self, seat: Seat) -> None:
        self._seated.pop(seat.number, None)
        self.sessions.release(seat)  # a no-op once opened

    def _admit_tree(self, s: _Session, rows: int, pending: list[int], admitted: int) -> int:
        """Admit a tree's KV (``rows``: its nodes and mask rows; nothing when they fit the
        session's slot) after ``admitted`` bytes and ``pending`` slots of the same batch;
        returns its bytes, and appends the slot it moves to (if any) to ``pending``."""
        need = s.kv.length + rows
        if need <= s.kv.capacity:
            return 0
        cost = self._placement_cost([*self._seated.values(), *pending], need)
        self.sessions.admit(admitted + cost, f"a verify of {rows} rows")
        pending.append(need)
        return cost

    def _new_session(self, call: PrefillCall, kv: SessionKV, last_logits: torch.Tensor,
                     feats: torch.Tensor) -> tuple[_Session, PrefillResult]:
        """The prefilled session (its KV committed) and its result; the caller opens it."""
        generator = torch.Generator(device="cpu")
        generator.manual_seed(call.sampling.seed if call.sampling.seed is not None else torch.seed())
        anchor = call.anchor
        if anchor is None:
            anchor = sample_token(last_logits, call.sampling, generator)
        session = _Session(kv, [*call.token_ids, anchor], call.sampling, generator)
        delta = FeatureDelta(0, tuple(call.token_ids), feats)
        return session, PrefillResult(anchor=anchor, delta=delta, base=len(call.token_ids))

    @torch.inference_mode()
    def verify(
        self, session_id: str, base: int, tree: TokenTree, want_node_probs: bool = False,
        chains: MaskChains | None = None,
    ) -> VerifyResult:
        call = VerifyCall(session_id, base, tree, want_node_probs, chains)
        s = self._check(call)
        self._admit_tree(s, call_rows(call), [], 0)
        return self._run([(s, call)], [])[0]

    @torch.inference_mode()
    def verify_batch(self, calls: Sequence[BatchCall]) -> list[BatchAnswer]:
        """Every valid call in ONE target forward: each tree (an AR step is a root-only
        tree), and each new session's prompt (``PrefillCall``, run whole; its ``decoded`` output
        after the forward, as chains; a prompt longer than ``prefill_chunk`` runs as ``prefill``
        runs it, in chunks, after the forward).

        Each call is checked as ``verify`` / ``prefill`` check it, and a session named twice
        is refused the second time (INVALID_ARGUMENT); a refused call gets its error in its
        slot and stays out of the forward, its session untouched. Each session then walks
        its own nodes with its own generator (so draws are those of sequential ``verify``)
        and keeps its accepted path; each prompt opens its session. Each call's positions
        are admitted against the KV budget as it is checked. A call that would take the
        forward past ``MAX_INVARIANT_ROWS`` rows (the call sizes whose kernels were probed
        row-invariant) is refused in its slot (RESOURCE_EXHAUSTED), unless it is the first.
        A failure anywhere leaves every session at its base and opens none.
        """
        out: list[BatchAnswer | None] = [None] * len(calls)
        verifies: list[tuple[int, _Session]] = []
        prompts: list[tuple[int, Seat]] = []
        chunked: list[int] = []  # prompts longer than a chunk: prefilled as ``prefill`` does, after
        seen: set[str] = set()
        pending: list[int] = []  # slots this batch's trees move to, not yet allocated
        admitted = 0  # their bytes (the prompts' are their seats')
        rows = 0  # of the one forward: a call that would pass the probed bound waits its turn
        try:
            for j, c in enumerate(calls):
                try:
                    check_once_per_batch(seen, c.session_id, f"verify_batch.calls[{j}]")
                    if isinstance(c, PrefillCall) and len(c.token_ids) - c.decoded > self.prefill_chunk:
                        # in chunks, as ``prefill`` runs it: a re-prefill (chunked) then rebuilds
                        # exactly this KV; its own forwards, after the batch's (which may fail whole)
                        chunked.append(j)
                        continue
                    n = call_rows(c)
                    if rows and rows + n > MAX_INVARIANT_ROWS:
                        raise LimitExceededError(
                            f"verify_batch.calls[{j}]: {rows + n} rows in one forward would pass the "
                            f"{MAX_INVARIANT_ROWS} whose kernels were probed row-invariant: send it again"
                        )
                    if isinstance(c, PrefillCall):
                        check_prompt(c.token_ids, c.anchor, self.vocab_size, self.limits.max_context,
                                     c.decoded)
                        prompts.append((j, self._seat(c.session_id, len(c.token_ids), c.restart, pending)))
                    else:
                        s = self._check(c)
                        admitted += self._admit_tree(s, n, pending, admitted)
                        verifies.append((j, s))
                    rows += n
                except EngineError as e:
                    out[j] = answer_of(e)
            if verifies or prompts:
                answers = self._run([(s, calls[j]) for j, s in verifies],
                                    [(calls[j], seat) for j, seat in prompts])
                for j, a in zip([j for j, _ in verifies] + [j for j, _ in prompts], answers):
                    out[j] = a
        finally:
            for _, seat in prompts:
                self._unseat(seat)
        for j in chunked:
            try:
                out[j] = Prefill(calls[j]).run(self)
            except EngineError as e:
                out[j] = answer_of(e)
        return out

    # -- verification steps, shared by verify and verify_batch ----------------------------
    def _check(self, call: VerifyCall) -> _Session:
        """The session, if the call may run on it; the named error otherwise."""
        s = self.sessions.touch(call.session_id)
        check_verify_call(call, s.base, s.tokens[-1], self.limits, self.self_draft_block)
        return s

    def _run(self, items: list[tuple[_Session, VerifyCall]],
             prompts: list[tuple[PrefillCall, Seat]]) -> list[VerifyResult | PrefillResult]:
        """Checked calls on distinct sessions: one forward, the walks, then the commits; the
        seated prompts' sessions open last. Answers: the verifies', then the prompts'.

        Only single-tree forwards refine the cost model (TAPS's ``c(B)`` is per tree), timed
        over the same span as the calibration's: the whole verification.
        """
        t0 = time.perf_counter()
        segments, input_ids, positions, mask_rows = [], [], [], []
        chains = [fit_chains(c, self.limits.max_context) for _, c in items]
        for (s, c), ch in zip(items, chains):
            start, paths = len(input_ids), list(c.tree.paths())
            input_ids += c.tree.tokens
            positions += [c.base + d for d in c.tree.depths]
            if ch is not None:  # each chain after its node: the node's path, then the chain so far
                for u in ch.after:
                    chain: tuple[int, ...] = ()
                    for j in range(1, ch.depth + 1):
                        chain += (len(input_ids) - start,)  # this row, in the segment
                        paths.append((*paths[u], *chain))
                        mask_rows.append(len(input_ids))
                        input_ids.append(0)  # ignored: the adapter's mask embedding
                        positions.append(c.base + c.tree.depths[u] + j)
            n = len(input_ids) - start
            segments.append(Segment(s.kv, start, n, None if n == 1 else tuple(paths)))
        for c, _ in prompts:  # a new session's prompt: causal, from position 0 (its decoded tail after)
            n, kv = len(c.token_ids) - c.decoded, self.kv_store.session()
            kv.reserve(len(c.token_ids))  # the slot its seat paid for, the decoded tail's included
            segments.append(Segment(kv, len(input_ids), n))
            input_ids += c.token_ids[:n]
            positions += range(n)
        rngs = [s.generator.get_state() for s, _ in items]
        try:
            hidden, feats = self.runner.forward(segments, input_ids, positions, mask_rows)
            # the walks' and the new prompts' logits in ONE lm_head matmul (a pass over the
            # head's weights costs about the same for 1 row as for 16): every node of a tree of
            # up to ``walk_rows`` nodes (its walk reads tau of them), the root of a larger one (its
            # walk reads the rest a row at a time), every prompt's last row. The head's rows
            # are row-invariant, so the walk is bitwise what one row at a time gives.
            rows_of = [range(seg.start, seg.start + (n if (n := len(c.tree.tokens)) <= self.walk_rows else 1))
                       for (_, c), seg in zip(items, segments)]
            rows_of += [range(seg.start + seg.n - 1, seg.start + seg.n) for seg in segments[len(items):]]
            heads = self.runner.logits(hidden[[r for rows in rows_of for r in rows]])
            first = [sum(len(rows) for rows in rows_of[:k]) for k in range(len(rows_of) + 1)]
            walked = []
            for k, ((s, c), seg, ch) in enumerate(zip(items, segments, chains)):
                rows = slice(seg.start, seg.start + len(c.tree.tokens))  # the tree's; its chains after
                known = heads[first[k] : first[k + 1]]
                walk, node_probs = self._walk(s, c.tree, hidden[rows], c.want_node_probs, known)
                walked.append((walk, node_probs, feats[rows], self._next_block(walk, hidden, rows.stop, ch)))
            opened = []
            for k, ((c, seat), seg) in enumerate(zip(prompts, segments[len(items):]), start=len(items)):
                last = heads[first[k]]
                seg.kv.keep(range(seg.n))
                # its own copy: a view would keep (and pickle, to a Ray driver) the whole batch's
                prompt_feats = feats[seg.start : seg.start + seg.n].clone()
                if c.decoded:  # a re-prefill's output: as the AR steps computed it, after the prompt
                    pieces = list(self.runner.decoded_chains(seg.kv, c.token_ids, seg.n, self.prefill_chunk))
                    last = self.runner.logits(pieces[-1][0][-1])
                    prompt_feats = torch.cat([prompt_feats, *(f for _, f, _ in pieces)])
                opened.append((seat, *self._new_session(c, seg.kv, last, prompt_feats)))
            results: list[VerifyResult | PrefillResult] = []
            for (s, c), (walk, node_probs, f, drafted) in zip(items, walked):
                s.kv.keep(walk.path)  # the tree's rows come first: the chains' are dropped
                results.append(self._commit(s, c.base, c.tree, walk, f, node_probs, drafted))
        except BaseException:
            for (s, c), rng in zip(items, rngs):
                _rollback(s, c.base, rng)  # never half-applied
            raise
        for seat, session, result in opened:
            self.sessions.open(seat, session)
            results.append(result)
        if len(items) == 1 and not prompts and self.forward_costs.prior is not None:
            (_, c), = items  # refine the fit, never replace it
            self.forward_costs.observe(segments[0].n, c.base, time.perf_counter() - t0)
        return results

    def _walk(
        self, s: _Session, tree: TokenTree, hidden: torch.Tensor, want_node_probs: bool,
        known: torch.Tensor,
    ) -> tuple[WalkResult, torch.Tensor | None]:
        """Sample-and-match over the tree's hidden states [N, H], with the session's generator;
        ``known``: the logits of its first nodes, computed with the forward's other rows."""
        if want_node_probs:  # traces need every node's parent distribution
            logits = known if len(known) == len(tree.tokens) else self.runner.logits(hidden)
            walk = walk_tree(tree, logits, s.sampling, s.generator)
            return walk, node_token_probs(tree, logits, s.sampling).cpu()

        def node_logits(node: int) -> torch.Tensor:  # the rest only where the walk reaches them
            return known[node] if node < len(known) else self.runner.logits(hidden[node])

        return walk_tree(tree, node_logits, s.sampling, s.generator), None

    def _next_block(self, walk: WalkResult, hidden: torch.Tensor, chains_start: int,
                    chains: MaskChains | None) -> DraftMarginals | None:
        """The marginals the chain after the walk's last node drafted (None: it had none)."""
        end = walk.path[-1]
        if chains is None or end not in chains.after:
            return None
        first = chains_start + chains.after.index(end) * chains.depth
        logp = torch.log_softmax(self.runner.logits(hidden[first : first + chains.depth]), dim=-1)
        return DraftMarginals.top_of(logp.cpu(), chains.top_k)

    def _commit(
        self, s: _Session, base: int, tree: TokenTree, walk: WalkResult, feats: torch.Tensor,
        node_probs: torch.Tensor | None, next_block: DraftMarginals | None = None,
    ) -> VerifyResult:
        """Commit the accepted path and the bonus (the KV cache already holds the path)."""
        path_tokens = [tree.tokens[i] for i in walk.path]
        s.tokens.extend([*path_tokens[1:], walk.bonus])
        delta = FeatureDelta(base, tuple(path_tokens), feats[torch.tensor(walk.path)].cpu(), next_block)
        return VerifyResult(
            accepted=tuple(path_tokens[1:]),
            bonus=walk.bonus,
            delta=delta,
            base=s.base,
            node_probs=node_probs,
            accepted_nodes=tuple(walk.path),
        )


def _rollback(s: _Session, base: int, rng: torch.Tensor) -> None:
    """Back to ``base``: the committed tokens and the generator's state (the KV's committed
    length only moves on success)."""
    s.kv.truncate(base)
    del s.tokens[base + 1 :]
    s.generator.set_state(rng)


def _max_context(config, requested: int) -> int:
    """Tree masks are full-attention masks: stay inside any sliding window the model has."""
    limit = min(requested, config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        limit = min(limit, window)
    return limit
