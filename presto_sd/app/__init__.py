"""The app: the presto-sd command line, bench and training."""
