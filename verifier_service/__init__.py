"""The verifier (target) gRPC service."""

import presto_sd  # noqa: F401  (first: the process-wide gRPC defaults, set before grpc loads)
