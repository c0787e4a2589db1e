"""gRPC plumbing shared by the drafter and verifier services (DESIGN.md §3).

``wire``: conversions between the domain dataclasses and ``presto_pb.v1`` messages;
``errors``: engine errors <-> status codes, in one place; ``server``: the grpc.aio server
(health, reflection, auth, limits, deadlines, drain); ``client``: channels for the
remote engines; ``cli``: ``presto-sd serve`` and the remote side of ``generate``.
"""
