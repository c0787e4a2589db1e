"""The method: token trees, scores, tree builders, TAPS, acceptance; pure (docs/design.md)."""
