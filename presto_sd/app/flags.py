"""The flags several commands share, defined once, and the configs they make.

Nothing heavy is imported at module level: ``presto-sd --help`` loads no torch.
"""

from __future__ import annotations

import argparse

from presto_sd.method.builders import TreeParams
from presto_sd.method.methods import DEFAULT_METHOD, METHOD_NAMES, METHODS

# presto_sd.models.loading.DTYPE_NAMES, without importing transformers for --help
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = ("model dtype: auto = bf16 on a GPU, and on a CPU with native bf16 (AVX512-BF16/AMX) "
              "whose kernels are row-invariant (speculative output bitwise the engine's AR), else "
              "fp32; start-up says which and why (docs/benchmarks.md)")
DECODER_CHOICES = ("auto", "owned", "transformers")  # presto_sd.embedded.target_runner.DECODERS, torch-free
DECODER_HELP = ("the verifier's forward: owned = presto-sd's own Llama/Qwen2/Qwen3 decoder "
                "(presto_sd/models/llama.py), transformers = the model's own module tree with the "
                "row-invariant linears swapped in; auto = owned where the target is of that family. "
                "Both are bitwise the same (tests/test_owned_decoder.py) (default: %(default)s)")
WEIGHTS_CHOICES = ("dense", "gguf-int4")  # presto_sd.models.quant.WEIGHTS, without importing torch for --help
WEIGHTS_HELP = ("the verifier's linear weights: dense = the loaded model's; gguf-int4 = the target GGUF's "
                "own Q4_1 blocks (and its Q8_0 head) through torch's int4 CPU kernel (bf16 activations "
                "where the CPU has native bf16; its rows probed at load), the owned decoder only: the "
                "fastest single stream on such a CPU, with --method ar (its trees cost more than they "
                "save there). Either way every method "
                "is bitwise that mode's own AR (default: %(default)s)")
METHOD_HELP = "; ".join(f"{m.name} = {m.help}" for m in METHODS.values())


def csv(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def parse_lambdas(text: str | None) -> tuple[float, ...] | None:
    """``--lambda``: one value or comma-separated per depth; None when not given."""
    return None if text is None else tuple(float(x) for x in str(text).split(","))


def add_tree_args(g: argparse._ArgumentGroup) -> None:
    """The tree's shape: depth, and presto-beam's branching and beam."""
    g.add_argument("--depth", type=int, default=TreeParams.depth, help="max tree depth (<= block size - 1)")
    g.add_argument("--branching", type=int, default=TreeParams.branching,
                   help="presto-beam: children per frontier path")
    g.add_argument("--beam", type=int, default=TreeParams.beam,
                   help="presto-beam: frontier paths kept per depth")
    g.add_argument("--self-chains", type=int, default=0,
                   help="self-speculative mode: mask chains per verify forward, after the tree's first N "
                        "nodes (default 0: after every node, so any accepted prefix has its next draft)")


def add_sampling_args(p: argparse.ArgumentParser, greedy_help: str = "0 (or below 1e-5) = greedy") -> None:
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0, help=greedy_help)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=0)


def add_model_args(p: argparse.ArgumentParser, target_help: str, drafter_help: str,
                   group: bool = True, decoder: bool = True) -> None:
    m = p.add_argument_group("models") if group else p
    m.add_argument("--target", default=None, help=target_help)
    m.add_argument("--drafter", default=None, help=drafter_help)
    m.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    m.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    if decoder:
        m.add_argument("--decoder", default="auto", choices=DECODER_CHOICES, help=DECODER_HELP)
        m.add_argument("--weights", default="dense", choices=WEIGHTS_CHOICES, help=WEIGHTS_HELP)


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """What one generation takes: method, tree, sampling and models (generate, serve orchestrator)."""
    g = p.add_argument_group("drafting")
    # the defaults' one home: DEFAULT_METHOD and TreeParams (the bench's fastest on a 2-core CPU)
    g.add_argument("--method", default=DEFAULT_METHOD, choices=METHOD_NAMES, help=METHOD_HELP)
    g.add_argument("--budget", type=int, default=TreeParams.budget,
                   help="draft tree nodes per round (root excluded); taps: the most it may choose "
                        "(default 4: the bench's fastest on a 2-core CPU; a GPU's flat verify cost "
                        "pays for larger trees)")
    add_tree_args(g)
    g.add_argument("--rho", default=None,
                   help="rho provider for PRESTO and TAPS: ngram | ngram-lookup | hphi | constant | "
                        "prefix | prefix-ngram | prefix-lookup (ngram-lookup: the drafter's top-K mixed "
                        "with what the request's own text followed the node's last two tokens with; the "
                        "last three: a drafter with a prefix head, the last two draw each node's "
                        "children from it), "
                        "taps also marginal (default: the drafter's; taps: hphi when shipped)")
    g.add_argument("--lambda", dest="lambdas", default=None,
                   help="lambda_d: one value or comma-separated per depth (default: the drafter's)")
    add_sampling_args(p)
    add_model_args(p, "a transformers dir, a .gguf file or a hub id (default: SmolLM2-135M-Instruct)",
                   "DFlash drafter dir or hub id owner/name (default: the shipped SmolLM2 one; "
                   "'random' = untrained; 'self' or 'self:DIR' = self-speculative: the target drafts "
                   "its own trees at mask rows, with the shipped or DIR's adapter)")


def add_client_args(g: argparse._ArgumentGroup, prefix: str = "", what: str = "the servers") -> None:
    """TLS and the bearer token for talking to gRPC servers (``prefix``: ``engine-`` for the
    orchestrator's engines)."""
    g.add_argument(f"--{prefix}tls-ca", default=None, help=f"PEM CA of {what}' certs (TLS on when set)")
    g.add_argument(f"--{prefix}tls-client-cert", default=None,
                   help="PEM client cert, for servers that want mTLS")
    g.add_argument(f"--{prefix}tls-client-key", default=None)
    g.add_argument(f"--{prefix}tls-server-name", default=None, help="name to check the server certs against")
    g.add_argument(f"--{prefix}auth-token-file", default=None, help=f"bearer token for {what}")


def client_config(args: argparse.Namespace, prefix: str = ""):
    """The ``ClientConfig`` of ``add_client_args``'s flags."""
    from presto_sd.rpc.client import ClientConfig, read_token

    def get(name: str):
        return getattr(args, prefix + name)

    return ClientConfig(tls_ca=get("tls_ca"), tls_cert=get("tls_client_cert"), tls_key=get("tls_client_key"),
                        auth_token=read_token(get("auth_token_file")), server_name=get("tls_server_name"))


def add_serving_args(g: argparse._ArgumentGroup) -> None:
    """A server's TLS and its clients' bearer token."""
    g.add_argument("--tls-cert", default=None, help="PEM server certificate (TLS on with --tls-key)")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-client-ca", default=None, help="PEM CA: require client certs it signed (mTLS)")
    g.add_argument("--auth-token-file", default=None,
                   help="clients must send 'authorization: Bearer <token>' of one of the file's lines, "
                        "each 'name:token' (a principal: sessions are its own) or one bare token")


def add_reflection_arg(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=None,
                   help="gRPC server reflection (grpcurl list), which needs no token (default: on, "
                        "off with --auth-token-file)")


def add_drain_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--drain-s", type=float, default=5.0,
                   help="on SIGTERM: NOT_SERVING this long before stopping (default: %(default)s)")
    g.add_argument("--grace-s", type=float, default=10.0,
                   help="then in-flight calls get this long (default: %(default)s)")


def server_config(args: argparse.Namespace):
    """The ``ServerConfig`` of a serving command's flags (those it lacks keep their defaults)."""
    from presto_sd.rpc.principals import read_tokens
    from presto_sd.rpc.server import ServerConfig

    extra = {k: getattr(args, k) for k in ("session_ttl_s", "max_message_mb") if hasattr(args, k)}
    token_file = getattr(args, "auth_token_file", None)
    return ServerConfig(
        host=args.host, port=args.port, tls_cert=getattr(args, "tls_cert", None),
        tls_key=getattr(args, "tls_key", None), tls_client_ca=getattr(args, "tls_client_ca", None),
        auth_tokens=read_tokens(token_file) if token_file else (),
        reflection=getattr(args, "reflection", None), drain_s=args.drain_s, grace_s=args.grace_s, **extra,
    )
