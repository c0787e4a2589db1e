"""Who a caller is: its principal, from its bearer token or its client certificate.

A token file holds one ``name:token`` a line (blank lines and ``#`` comments skipped);
each line is a principal. A file of one bare token (no ``:``) is the principal
``default``: the one-token files of before. A client reads its token the same way: the
part after the first ``:`` when there is one, so either file works on both sides.

Without tokens, a caller with a mutual-TLS certificate is ``cert:<its subject CN>``, and
any other is ``anonymous``. Servers keep each caller's sessions apart by principal.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from pathlib import Path

ANONYMOUS = "anonymous"
DEFAULT = "default"  # the principal of a bare token
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")


def parse_tokens(text: str, where: str = "the token file") -> tuple[tuple[str, str], ...]:
    """``(name, token)`` per line; ValueError naming the line for anything malformed."""
    lines = [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1)]
    lines = [(i, line) for i, line in lines if line and not line.startswith("#")]
    if not lines:
        raise ValueError(f"{where}: no token in it")
    out: list[tuple[str, str]] = []
    for i, line in lines:
        if ":" not in line:
            if len(lines) > 1:
                raise ValueError(f"{where}, line {i}: 'name:token' expected (a bare token only alone)")
            out.append((DEFAULT, line))
            continue
        name, token = (part.strip() for part in line.split(":", 1))
        if not _NAME.fullmatch(name):
            raise ValueError(f"{where}, line {i}: principal name {name!r}: letters, digits, _.@- (1..64)")
        if not token:
            raise ValueError(f"{where}, line {i}: empty token")
        out.append((name, token))
    names, tokens = [n for n, _ in out], [t for _, t in out]
    if len(set(names)) != len(names) or len(set(tokens)) != len(tokens):
        raise ValueError(f"{where}: a principal name or token appears twice")
    return tuple(out)


def read_tokens(path: str) -> tuple[tuple[str, str], ...]:
    return parse_tokens(Path(path).read_text(), path)


def client_token(path: str) -> str:
    """The one token a client sends (a file of one line, bare or ``name:token``)."""
    entries = read_tokens(path)
    if len(entries) != 1:
        raise ValueError(f"{path}: a client's token file holds one token, this one {len(entries)}")
    return entries[0][1]


@dataclass(frozen=True)
class Principals:
    """The principals a server knows by token."""

    tokens: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if not self.tokens or any(not t.strip() for _, t in self.tokens):
            raise ValueError("the auth token is empty")

    def who(self, authorization: str | bytes) -> str | None:
        """The principal whose ``Bearer <token>`` this is; None for a missing or wrong one.

        Every token is compared (in constant time), so the answer's timing tells nothing.
        """
        got = authorization.encode() if isinstance(authorization, str) else authorization
        found = None
        for name, token in self.tokens:
            if hmac.compare_digest(got, f"Bearer {token}".encode()):
                found = name
        return found
