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
"""

from __future__ import annotations

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


class OrchestratorClient:
    def __init__(self, address: str, config: ClientConfig | None = None, timeout_s: float = 600.0) -> None:
        self.rpc = RpcClient(address, config or ClientConfig(), UnavailableError)
        self.stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self.rpc.channel)
        self.timeout_s = timeout_s

    def generate(self, prompt: Prompt, **options: Any) -> Iterator[StreamChunk]:
        """Chunks as the rounds commit; the last has ``finish_reason``."""
        call = self.stub.Generate(make_request(prompt, **options), timeout=self.timeout_s,
                                  metadata=self.rpc.metadata)
        try:
            for msg in call:
                yield chunk_from_pb(msg)
        except grpc.RpcError as err:
            raise error_from_rpc(err, UnavailableError) from None
        finally:
            call.cancel()  # a no-op once the stream has ended

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
        self.rpc.close()
