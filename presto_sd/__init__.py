"""presto-sd: lossless tree speculative decoding with diffusion drafters (PRESTO, TAPS)."""

import os

# gRPC's fork handlers are off in every presto-sd process. A process that has used gRPC and
# then forks (Ray's ray.init and subprocess.Popen with a preexec_fn both fork before exec)
# runs them, and they restart gRPC threads in the child: measured, 65 of 300 children of a
# process that had served gRPC aborted before their exec (a Ray service that never starts).
# No presto-sd process uses gRPC in a forked child; each child execs.
# tests/test_fork.py holds it. Set before anything imports grpc; a user's value wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

__version__ = "0.1.0"
