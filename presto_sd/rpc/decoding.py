"""How a server reads a request: its size budget first, then the parse, big ones off the loop.

grpc's own deserializer runs before any interceptor, so a message that did not parse used
to fail inside grpc (UNKNOWN). The server hands grpc ``deferred`` instead, which only wraps
the bytes; ``RawRequest.message`` then checks the budget and parses, inside the call, where
a failure is a status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED) like any other.

The budget is read off the wire format (tags and lengths, never entries), so it costs
O(fields) however big a field is: at most ``MAX_FIELDS`` field occurrences and
``MAX_PACKED_BYTES`` of packed repeated numbers in one request. A parse holds the GIL for
its whole run (~50 ns an entry), so without this a message of packed numbers near the
message cap (512 MB) would stall the event loop, health checks included, for half a minute.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from presto_sd.engine.messages import InvalidArgumentError, LimitExceededError

INLINE_BYTES = 1 << 20  # messages up to this size are parsed and serialised on the event loop
MAX_FIELDS = 1 << 16  # field occurrences in one request: sub-messages, unpacked entries, ...
MAX_PACKED_BYTES = 8 << 20  # packed repeated numbers in one request, together (a parse of ~0.4 s)
_DECODE = ThreadPoolExecutor(max_workers=2, thread_name_prefix="decode")


async def off_loop(size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: inline when ``size`` (bytes) is small, else on a decode thread, so a big
    message's parse or conversion leaves the event loop free where the GIL allows."""
    if size <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_DECODE, fn, *args)


# -- the budget, from the wire format -----------------------------------------------------
def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(data) and shift < 70:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos
    return -1, len(data) + 1  # truncated or overlong: corrupt


def check_budget(data: bytes, descriptor: Any) -> None:
    """Refuse (``LimitExceededError``) a message over ``MAX_FIELDS`` or ``MAX_PACKED_BYTES``.

    A corrupt message ends the scan quietly: the parse that follows names the problem.
    """
    fields = packed = 0
    todo = [(descriptor, 0, len(data))]
    while todo:
        desc, pos, end = todo.pop()
        while pos < end:
            tag, pos = _varint(data, pos)
            fields += 1
            if fields > MAX_FIELDS:
                raise LimitExceededError(f"request: more than {MAX_FIELDS} fields (the limit of one request)")
            wire, field = tag & 7, desc.fields_by_number.get(tag >> 3) if tag > 0 else None
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 2:
                n, pos = _varint(data, pos)
                if n < 0 or pos + n > end:
                    return
                if field is not None and field.message_type is not None:
                    todo.append((field.message_type, pos, pos + n))
                elif field is not None and field.is_repeated and field.type not in (field.TYPE_STRING,
                                                                                    field.TYPE_BYTES):
                    packed += n
                    if packed > MAX_PACKED_BYTES:
                        raise LimitExceededError(
                            f"request: more than {MAX_PACKED_BYTES >> 20} MiB of repeated numbers "
                            f"(the limit of one request), {field.full_name} among them")
                pos += n
            else:
                return  # groups (no proto here has one) or a wire type that does not exist


# -- requests and answers as the server's interceptor hands them on ---------------------
@dataclass(frozen=True)
class RawRequest:
    """A request as it arrived, parsed by ``message`` inside the call."""

    data: bytes
    parse: Callable[[bytes], Any]  # the message class's FromString

    def message(self) -> Any:
        descriptor = getattr(getattr(self.parse, "__self__", None), "DESCRIPTOR", None)
        if descriptor is not None:
            check_budget(self.data, descriptor)
        try:
            return self.parse(self.data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or what else a corrupt payload raises
            raise InvalidArgumentError(f"request: {exc}") from None


def deferred(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], RawRequest]:
    """The request deserializer the server gives grpc: it cannot fail."""
    parse = parse or (lambda data: data)
    return lambda data: RawRequest(data, parse)


def passing_bytes(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes]:
    """The response serializer, for answers a call may have serialised off the loop already."""
    serialize = serialize or (lambda response: response)
    return lambda response: response if isinstance(response, bytes) else serialize(response)
