"""``OrchestratorClient``: generation through a running ``presto-sd serve orchestrator``.

    client = OrchestratorClient("127.0.0.1:50050")
    for chunk in client.generate("Write a haiku.", max_new_tokens=64):
        print(chunk.text, end="")
    results = client.generate_batch(["2+2?", [0, 3, 5]], method="presto-beam")  # result or error each

Prompts are text (one user message, chat template applied server-side), chat messages
(``[{"role": "user", "content": ...}, ...]``) or token ids. Unset options take the
server's defaults; ``tree`` and ``sampling`` are dicts of the fields to set
(``{"budget": 32}``, ``{"temperature": 0.7, "seed": 1}``). Stopping the iteration early
(``break``, ``close()``) cancels the request, which frees its sessions on both engines.

Resuming: given several orchestrators (``"h1:p,h2:p"`` or a list), a ``generate`` stream
that breaks with UNAVAILABLE or CANCELLED (its orchestrator died, or went away) goes on
on the next one: the client sends the same request with ``resume_token_ids``, the tokens
it already yielded, and yields only what follows (greedy: exactly the unbroken stream's
tokens). It keeps trying, round the list with a short back-off, for ``resume_s`` seconds
after each break (30 by default with several addresses; 0, no resuming, with one — set
it to retry the same address, e.g. behind a load balancer). ``resumes`` counts them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from orchestrator.pb import Prompt, chunk_from_pb, make_request
from orchestrator.requests import StreamChunk
from presto_pb.v1 import common_pb2, orchestrator_pb2_grpc
from presto_pb.v1 import orchestrator_pb2 as pb
from presto_sd.engine.messages import EngineError, UnavailableError
from presto_sd.rpc.client import ClientConfig, RpcClient
from presto_sd.rpc.errors import error_from_rpc, error_from_status

_RESUMABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class OrchestratorClient:
    def __init__(self, address: str | Sequence[str], config: ClientConfig | None = None,
                 timeout_s: float = 600.0, resume_s: float | None = None) -> None:
        addresses = [a.strip() for a in address.split(",")] if isinstance(address, str) else list(address)
        if not addresses or not all(addresses):
            raise ValueError(f"orchestrator address {address!r}: give HOST:PORT[,HOST:PORT...]")
        config = config or ClientConfig()
        self.rpcs = [RpcClient(a, config, UnavailableError) for a in addresses]
        self.stubs = [orchestrator_pb2_grpc.OrchestratorServiceStub(r.channel) for r in self.rpcs]
        self.current = 0  # the orchestrator calls go to; a broken stream moves it on
        self.timeout_s = timeout_s
        self.resume_s = resume_s if resume_s is not None else (30.0 if len(addresses) > 1 else 0.0)
        self.resumes = 0  # streams resumed after a break

    @property
    def rpc(self) -> RpcClient:
        return self.rpcs[self.current]

    @property
    def stub(self) -> orchestrator_pb2_grpc.OrchestratorServiceStub:
        return self.stubs[self.current]

    def generate(self, prompt: Prompt, **options: Any) -> Iterator[StreamChunk]:
        """Chunks as the rounds commit; the last has ``finish_reason``. A break is resumed
        on the next orchestrator when ``resume_s`` allows (see the module's doc)."""
        received = list(options.pop("resume_token_ids", ()))  # the caller may resume a stream too
        give_up, pause = None, 0.1
        while True:
            resumed = bool(received) or give_up is not None
            call = self.stub.Generate(make_request(prompt, resume_token_ids=received, **options),
                                      timeout=self.timeout_s, metadata=self.rpc.metadata)
            try:
                for msg in call:
                    chunk = chunk_from_pb(msg)
                    if resumed and chunk.stats is None and not chunk.tokens and not chunk.finish_reason:
                        continue  # the resumed request's prefill: nothing the caller has not seen
                    received.extend(chunk.tokens)
                    give_up, pause = None, 0.1  # progress: a later break gets the whole budget
                    yield chunk
                return
            except grpc.RpcError as err:
                now = time.monotonic()
                give_up = give_up if give_up is not None else now + self.resume_s
                if err.code() not in _RESUMABLE or now >= give_up:
                    raise error_from_rpc(err, UnavailableError) from None
            finally:
                call.cancel()  # a no-op once the stream has ended
            self.current = (self.current + 1) % len(self.rpcs)
            self.resumes += 1
            time.sleep(min(pause, max(0.0, give_up - time.monotonic())))
            pause = min(2 * pause, 2.0)

    def generate_batch(
        self, prompts: Sequence[Prompt], **options: Any
    ) -> list[pb.GenerateResult | EngineError]:
        """Every prompt with the same options, run concurrently; in order, each its result or
        the named error a ``generate`` of it would raise (a bad prompt fails only its slot)."""
        request = pb.GenerateBatchRequest(requests=[make_request(p, **options) for p in prompts])
        results = self.rpc.call(self.stub.GenerateBatch, request, self.timeout_s).results
        return [error_from_status(r.error.code, r.error.message, UnavailableError)
                if r.HasField("error") else r for r in results]

    def info(self) -> pb.OrchestratorInfo:
        return self.rpc.call(self.stub.Info, common_pb2.InfoRequest(), 30.0)

    def close(self) -> None:
        for rpc in self.rpcs:
            rpc.close()
