"""``presto-sd bench``: side-by-side measurement of every drafting method against AR and a peer.

- ``stats``: pure arithmetic (tau, tokens/s, speedup, time split, lossless) over run logs.
- ``methods``: the registry of methods by name (``ar``, the tree builders); ``hf_lookup``
  adds transformers' prompt lookup, the peer.
- ``runner``: the interleaved loop (``run_bench``) and ``bench``, which also writes the
  outputs (``report``: JSON / Markdown; ``plots``: PNGs).
- ``cli``: the ``presto-sd bench`` subcommand.
"""
