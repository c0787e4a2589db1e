"""``OrchestratorService`` over gRPC: thin ``from_pb -> orchestrator -> to_pb`` adapters.

A request's unset fields take the server's defaults (``ServiceDefaults``: the flags of
``presto-sd serve orchestrator`` and the drafter's fitted PRESTO settings). Errors become
status codes in the server's one interceptor (``presto_sd.rpc.server``); a client that
cancels a ``Generate`` stream cancels the request, which closes both of its sessions.
``GenerateBatch`` answers each item in its slot: its result, or its own error. A prompt's
size is checked before it is read, and requests are converted (tokenised) on one thread of
their own: off the event loop, and one at a time (the tokenizer is not safe to share).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace

import grpc

from orchestrator.orchestrator import Orchestrator
from orchestrator.pb import chunk_to_pb
from orchestrator.requests import GenerateJob
from presto_pb.v1 import common_pb2, orchestrator_pb2_grpc
from presto_pb.v1 import orchestrator_pb2 as pb
from presto_sd.engine.drafter import DrafterInfo
from presto_sd.engine.messages import InvalidArgumentError, LimitExceededError
from presto_sd.loop.generate import GenerationParams, ResultCollector
from presto_sd.method.builders import TreeParams
from presto_sd.method.methods import METHOD_NAMES, get_method
from presto_sd.models.loading import encode_messages
from presto_sd.rpc.errors import status_of
from presto_sd.rpc.principals import ANONYMOUS
from presto_sd.rpc.server import EngineHost, current_principal
from presto_sd.rpc.wire import (
    MAX_TOKENS,
    check_length,
    sampling_from_pb,
    session_id_from,
    tree_params_from_pb,
    tree_params_to_pb,
)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["OrchestratorService"].full_name
add_to_server = orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server
ROLES = ("system", "user", "assistant")
MAX_PROMPT_CHARS = 1 << 22  # text, or the chat messages' contents together (4 Mi characters)
MAX_MESSAGES = 1024
MAX_STOP, MAX_STOP_CHARS = 16, 1024  # stop strings: each is searched for after every token
log = logging.getLogger("orchestrator")


@dataclass(frozen=True)
class ServiceDefaults:
    params: GenerationParams  # stop_token_ids: the target's EOS
    model: str = ""
    drafter: str = "random"
    drafter_info: DrafterInfo | None = None  # its fitted PRESTO settings fill in rho and lambdas
    rho: str | None = None  # the server's --rho, if given (else the drafter's, per method)
    lambdas: tuple[float, ...] | None = None  # the server's --lambda, if given (else per rho)
    vocab_size: int = 0  # the target's, to check resume_token_ids (0: the verifier checks them)

    def tree_settings(self, method: str, rho: str | None, lambdas: tuple[float, ...] | None):
        """``(rho, lambdas)`` of a request as ``generate`` makes them embedded: what the request
        sets, else the server's flags, else the drafter's fitted ones for the method and rho."""
        info, tree = self.drafter_info, self.params.tree
        if info is None:  # no drafter settings to fill in from: the server's own
            return (rho if rho is not None else tree.rho, lambdas if lambdas is not None else tree.lambdas)
        return info.defaults.tree_settings(
            rho if rho is not None else self.rho, lambdas if lambdas is not None else self.lambdas,
            get_method(method).wants_calibrated_rho, info.rho_providers)


# -- requests ---------------------------------------------------------------------------
def _prompt_ids(msg: pb.GenerateRequest, tokenizer) -> list[int]:
    which = msg.WhichOneof("prompt")
    if which is None:
        raise InvalidArgumentError("prompt: set one of text, messages, token_ids")
    if which == "token_ids":
        check_length(len(msg.token_ids.ids), MAX_TOKENS, "token_ids.ids")
        ids = list(msg.token_ids.ids)
    else:
        if tokenizer is None:
            raise InvalidArgumentError(f"{which}: this orchestrator has no tokenizer; send token_ids")
        if which == "text":
            messages = [{"role": "user", "content": msg.text}]
        else:
            check_length(len(msg.messages.messages), MAX_MESSAGES, "messages")
            messages = [{"role": m.role, "content": m.content} for m in msg.messages.messages]
            bad = next((i for i, m in enumerate(messages) if m["role"] not in ROLES), None)
            if bad is not None:
                raise InvalidArgumentError(
                    f"messages[{bad}].role = {messages[bad]['role']!r}: one of {', '.join(ROLES)}")
        chars = sum(len(m["content"]) for m in messages)
        if chars > MAX_PROMPT_CHARS:
            raise LimitExceededError(f"{which}: {chars} characters, more than the limit {MAX_PROMPT_CHARS}")
        ids = encode_messages(tokenizer, messages, chat=not msg.no_chat)
    if not ids:
        raise InvalidArgumentError(f"{which}: the prompt is empty")
    return ids


_TREE_FIELDS = frozenset(f.name for f in fields(TreeParams))


def _given(msg) -> set[str]:
    """The fields a message sets (proto3 presence): these override the server's defaults."""
    return {fd.name for fd, _ in msg.ListFields()}


def job_from_pb(msg: pb.GenerateRequest, defaults: ServiceDefaults, tokenizer,
                principal: str = ANONYMOUS) -> GenerateJob:
    d = defaults.params
    if len(msg.stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in msg.stop[:MAX_STOP]):
        raise InvalidArgumentError(f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")
    method = msg.method if msg.HasField("method") else d.method
    if method not in METHOD_NAMES:
        raise InvalidArgumentError(f"method = {method!r}: one of {', '.join(METHOD_NAMES)}")
    tree, sampling = tree_params_from_pb(msg.tree), sampling_from_pb(msg.sampling)  # checked
    # a request's tree is configuration: what a round measures (cost, draft_s, ...) is the
    # step engine's to fill, so those fields of the message are not the request's to set
    given = {k: getattr(tree, k) for k in _given(msg.tree) if k in _TREE_FIELDS}
    given["rho"], given["lambdas"] = defaults.tree_settings(method, given.get("rho"), given.get("lambdas"))
    if msg.tree.HasField("method") and msg.tree.method != method:  # one method: the request's
        raise InvalidArgumentError(f"tree.method = {msg.tree.method!r}: a request names its method in "
                                   f"`method` ({method!r}); leave tree.method unset")
    try:  # the dataclasses validate the combination and name the field
        params = replace(
            d, method=method,
            tree=replace(d.tree, **given),
            sampling=replace(d.sampling, **{k: getattr(sampling, k) for k in _given(msg.sampling)}),
            max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else d.max_new_tokens,
            stop_strings=tuple(msg.stop),
        )
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None
    if params.stop_strings and tokenizer is None:
        raise InvalidArgumentError("stop: stop strings need a tokenizer, and this orchestrator has none")
    rid = session_id_from(msg.request_id, "request_id") if msg.request_id else uuid.uuid4().hex
    resume = _resume_ids(msg, params.max_new_tokens, defaults.vocab_size)
    return GenerateJob(tuple(_prompt_ids(msg, tokenizer)), params, rid, principal, resume=resume)


def _resume_ids(msg: pb.GenerateRequest, max_new_tokens: int, vocab_size: int) -> tuple[int, ...]:
    ids = tuple(msg.resume_token_ids)
    if len(ids) > max_new_tokens:
        raise InvalidArgumentError(
            f"resume_token_ids: {len(ids)} tokens, more than max_new_tokens {max_new_tokens}")
    top = vocab_size or 2**31
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < top), None)
    if bad is not None:
        raise InvalidArgumentError(f"resume_token_ids[{bad}] = {ids[bad]}: out of range [0, {top})")
    return ids


# -- answers ----------------------------------------------------------------------------
async def collect(orch: Orchestrator, job: GenerateJob) -> pb.GenerateResult:
    """Run one request to the end; its tokens, text and round summary."""
    out = ResultCollector()
    async for chunk in orch.astream(job):
        out.add(chunk.tokens, chunk.stats, chunk.finish_reason, chunk.text)
    res = out.result()
    return pb.GenerateResult(
        request_id=job.request_id, token_ids=res.token_ids, text=res.text, finish_reason=res.finish_reason,
        rounds=len(res.rounds), tau=res.tau, mean_tree_size=res.mean_tree_size,
        fallback_rounds=sum(r.fallback for r in res.rounds), prefill_s=res.prefill_s, decode_s=res.decode_s,
    )


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer, EngineHost):
    def __init__(self) -> None:
        EngineHost.__init__(self, "orchestrator")
        self.defaults: ServiceDefaults | None = None  # set by the loader, with the tokenizer
        self.tokenizer = None
        self._requests = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchestrator-requests")

    async def job(self, msg: pb.GenerateRequest) -> GenerateJob:
        """``job_from_pb`` on the requests' thread (tokenising a long prompt takes a while)."""
        loop = asyncio.get_running_loop()
        principal = current_principal()  # the call's, read here: executor threads do not inherit it
        return await loop.run_in_executor(self._requests, job_from_pb, msg, self.defaults, self.tokenizer,
                                          principal)

    def shutdown(self) -> None:
        super().shutdown()
        self._requests.shutdown(wait=False, cancel_futures=True)

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        orch: Orchestrator = self.ready()
        job = await self.job(request)
        tree = tree_params_to_pb(job.params.tree, method=job.params.method)  # told once, with the first chunk
        async for chunk in orch.astream(job):
            yield chunk_to_pb(chunk, job.request_id, tree)
            tree = None

    async def GenerateBatch(self, request, context: grpc.aio.ServicerContext):
        orch: Orchestrator = self.ready()
        n, cap = len(request.requests), orch.config.max_requests
        if n > cap:  # they could not all run: refused before any is read
            raise LimitExceededError(f"generate_batch: {n} requests, more than --max-requests {cap}")
        # a cancelled call cancels every item (gather cancels its children)
        results = await asyncio.gather(*(self._batch_item(orch, r) for r in request.requests))
        return pb.GenerateBatchResponse(results=results)

    async def _batch_item(self, orch: Orchestrator, msg: pb.GenerateRequest) -> pb.GenerateResult:
        """One item to the end, or the status a ``Generate`` of it would end with, in its slot."""
        try:
            return await collect(orch, await self.job(msg))
        except Exception as exc:  # noqa: BLE001 - one item's failure is its own answer
            code, message = status_of(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("GenerateBatch item failed")
            error = common_pb2.ItemError(code=code.name, message=message)
            return pb.GenerateResult(request_id=msg.request_id, error=error)

    async def Info(self, request, context: grpc.aio.ServicerContext):
        orch: Orchestrator = self.ready()
        d = self.defaults
        return pb.OrchestratorInfo(
            model=d.model, drafter=d.drafter,
            drafter_replicas=[r.name for r in orch.drafters.replicas],
            verifier_replicas=[r.name for r in orch.verifiers.replicas],
            default_method=d.params.method, default_tree=tree_params_to_pb(d.params.tree),
            default_max_new_tokens=d.params.max_new_tokens, max_requests=orch.config.max_requests,
            tokenizer=self.tokenizer is not None,
            links=[pb.ReplicaLink(service=r.kind, replica=r.name, round_trip_s=r.round_trip_s(),
                                  calls=r.engine.link.count)
                   for pool in (orch.drafters, orch.verifiers) for r in pool.replicas],
        )
