"""presto-sd: lossless tree speculative decoding with diffusion drafters (PRESTO, TAPS)."""

__version__ = "0.1.0"
