"""``OrchestratorService`` over gRPC: thin ``from_pb -> orchestrator -> to_pb`` adapters.

A request's unset fields take the server's defaults (``ServiceDefaults``: the flags of
``presto-sd serve orchestrator`` and the drafter's fitted PRESTO settings). Errors become
status codes in the server's one interceptor (``presto_sd.rpc.server``); a client that
cancels a ``Generate`` stream cancels the request, which closes both of its sessions.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, replace

import grpc

from orchestrator.orchestrator import Orchestrator
from orchestrator.pb import chunk_to_pb
from orchestrator.requests import GenerateJob
from presto_pb.v1 import orchestrator_pb2 as pb
from presto_pb.v1 import orchestrator_pb2_grpc
from presto_sd.engine.drafter import DrafterInfo
from presto_sd.engine.messages import InvalidArgumentError
from presto_sd.loop.generate import GenerationParams, ResultCollector
from presto_sd.method.methods import METHOD_NAMES, get_method
from presto_sd.models.loading import encode_messages
from presto_sd.rpc.principals import ANONYMOUS
from presto_sd.rpc.server import EngineHost, current_principal
from presto_sd.rpc.wire import (
    sampling_from_pb,
    session_id_from,
    tree_params_from_pb,
    tree_params_to_pb,
)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["OrchestratorService"].full_name
add_to_server = orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server
ROLES = ("system", "user", "assistant")


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
        ids = list(msg.token_ids.ids)
    else:
        if tokenizer is None:
            raise InvalidArgumentError(f"{which}: this orchestrator has no tokenizer; send token_ids")
        if which == "text":
            messages = [{"role": "user", "content": msg.text}]
        else:
            messages = [{"role": m.role, "content": m.content} for m in msg.messages.messages]
            bad = next((i for i, m in enumerate(messages) if m["role"] not in ROLES), None)
            if bad is not None:
                raise InvalidArgumentError(
                    f"messages[{bad}].role = {messages[bad]['role']!r}: one of {', '.join(ROLES)}")
        ids = encode_messages(tokenizer, messages, chat=not msg.no_chat)
    if not ids:
        raise InvalidArgumentError(f"{which}: the prompt is empty")
    return ids


def _given(msg) -> set[str]:
    """The fields a message sets (proto3 presence): these override the server's defaults."""
    return {fd.name for fd, _ in msg.ListFields()}


def job_from_pb(msg: pb.GenerateRequest, defaults: ServiceDefaults, tokenizer,
                principal: str = ANONYMOUS) -> GenerateJob:
    d = defaults.params
    method = msg.method if msg.HasField("method") else d.method
    if method not in METHOD_NAMES:
        raise InvalidArgumentError(f"method = {method!r}: one of {', '.join(METHOD_NAMES)}")
    tree, sampling = tree_params_from_pb(msg.tree), sampling_from_pb(msg.sampling)  # checked
    given = {k: getattr(tree, k) for k in _given(msg.tree)}
    given["rho"], given["lambdas"] = defaults.tree_settings(method, given.get("rho"), given.get("lambdas"))
    if "method" not in given:
        given["method"] = get_method(method).tree_method
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

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        orch: Orchestrator = self.ready()
        job = job_from_pb(request, self.defaults, self.tokenizer, current_principal())
        tree = tree_params_to_pb(job.params.tree)  # told once, with the first chunk
        async for chunk in orch.astream(job):
            yield chunk_to_pb(chunk, job.request_id, tree)
            tree = None

    async def GenerateBatch(self, request, context: grpc.aio.ServicerContext):
        orch: Orchestrator = self.ready()
        jobs = [job_from_pb(r, self.defaults, self.tokenizer, current_principal()) for r in request.requests]
        async with asyncio.TaskGroup() as group:  # one failure cancels the rest
            tasks = [group.create_task(collect(orch, job)) for job in jobs]
        return pb.GenerateBatchResponse(results=[t.result() for t in tasks])

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
        )
