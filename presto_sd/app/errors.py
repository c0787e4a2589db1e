"""The one error a command says in a line: what the user asked for cannot be done as asked.

Each command group's own refusals (a bad flag value, a corpus or prompt set that is missing or
malformed, a work dir made with other settings) derive from ``UsageError`` as well as from
``ValueError``, so callers that catch ``ValueError`` keep working. ``presto-sd``'s ``main``
prints a ``UsageError`` as ``presto-sd: <message>`` on stderr and exits 1: no traceback, since
the message alone says the fix. Anything else is a bug, and keeps its
traceback.
"""

from __future__ import annotations


class UsageError(Exception):
    """A request that cannot be carried out as given; its message says why and what to change."""
