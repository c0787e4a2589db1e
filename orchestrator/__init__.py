"""The Ray orchestrator: pipelines rounds across requests over drafter and verifier replicas."""

import presto_sd  # noqa: F401  (first: the process-wide gRPC defaults, set before grpc loads)
