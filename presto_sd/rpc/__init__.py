"""gRPC plumbing shared by the drafter and verifier services (docs/design.md §3).

``wire``: conversions between the domain dataclasses and ``presto_pb.v1`` messages;
``errors``: engine errors <-> status codes, in one place; ``server``: the grpc.aio server
(health, reflection, auth, limits, deadlines, drain); ``client``: channels for the
remote engines. The ``presto-sd serve`` command is the app's (``presto_sd/app/serve.py``).
"""
