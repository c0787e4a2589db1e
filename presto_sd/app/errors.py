"""The one error a command says in a line: what the user asked for cannot be done as asked.

The refusals that derive from ``UsageError`` (a bad flag value, a corpus or prompt set that is
missing or malformed, a work dir made with other settings, an output dir that must be new) also
derive from ``ValueError`` or ``FileExistsError``, so callers that catch those keep working.
``presto-sd``'s ``main`` prints a ``UsageError`` as ``presto-sd: <message>`` on stderr and exits
1: no traceback, since the message alone says the fix. Anything else is a bug, and keeps its
traceback: a plain ``ValueError`` is a bug's (an invariant of the code, not of its input).
"""

from __future__ import annotations


class UsageError(Exception):
    """A request that cannot be carried out as given; its message says why and what to change."""


class FlagError(UsageError, ValueError):
    """A flag's value, or a combination of flags, a command cannot run with."""


class OutputExistsError(UsageError, FileExistsError):
    """An output dir that must be new or empty is not (nothing in it is touched)."""
