"""Hostile requests for the wire fuzz (``tests/test_fuzz.py``): random bytes, byte-mutated
valid messages, and valid messages with fields set to out-of-range values (extreme ints,
NaN, inf and subnormal floats, wrong session ids, huge repeated fields), sent raw to any
gRPC method with a deadline; every answer's status code is recorded."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import FieldDescriptor as F

INT32 = [0, 1, -1, 2, 3, 7, 15, 16, 17, 99, 1024, 1025, 2**31 - 1, -(2**31)]
INT64 = [0, 1, -1, 4, 511, 512, 2**40, 2**63 - 1, -(2**63)]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, math.nan, math.inf, -math.inf, 1e-300, 5e-324, 1e-45, 1e-6, 1e300]
STRINGS = ["", "x", "fz-live", "fz-gone", "ar", "linear", "marginal", "presto-beam", "presto-best-first",
           "taps", "ngram", "constant", "hphi", "float32", "bfloat16", "float8", "user", "\u2603", "a" * 300]
SIZES = [0, 1, 2, 5, 64, 1025, 5000, 70000]  # entries of a repeated field
# a server's CANCELLED is not among them: the fuzz's own end of a long stream is an OK
# (``send``), so a server that cancels calls by itself breaks the rule
ALLOWED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
           "ALREADY_EXISTS"}


def scalar(f, rng: random.Random):
    """A hostile value for a scalar field of ``f``'s type."""
    t = f.type
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return rng.choice(FLOATS) if rng.random() < 0.8 else rng.uniform(-3, 3)
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return rng.choice(INT64) if rng.random() < 0.7 else rng.randint(-3, 40)
    if t in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED32, F.TYPE_FIXED64):
        return abs(rng.choice(INT32))
    if t == F.TYPE_BOOL:
        return rng.random() < 0.5
    if t == F.TYPE_STRING:
        return rng.choice(STRINGS) if rng.random() < 0.8 else f"fz-{rng.randrange(10**6)}"
    if t == F.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 1, 7, 64, 256, 1000]))
    if t == F.TYPE_ENUM:
        return rng.choice(f.enum_type.values).number
    return rng.choice(INT32) if rng.random() < 0.7 else rng.randint(-3, 40)  # int32-like


def mutate(msg, rng: random.Random, depth: int = 0) -> None:
    """Set one to three fields of ``msg`` (in place, nested messages too) to hostile values."""
    fields = list(msg.DESCRIPTOR.fields)
    if not fields:
        return
    for f in rng.sample(fields, k=rng.randint(1, min(3, len(fields)))):
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            continue  # maps are in answers only
        if f.message_type is not None and f.is_repeated:
            n = rng.choice([0, 1, 2, 3, 70, 300])
            del value[:]
            for _ in range(n):
                item = value.add()
                if depth < 2 and rng.random() < 0.5:
                    mutate(item, rng, depth + 1)
        elif f.message_type is not None:
            if depth < 3:
                mutate(value, rng, depth + 1)
        elif f.is_repeated:
            n = rng.choice(SIZES)
            one = scalar(f, rng)
            values = [one] * n if rng.random() < 0.5 else [scalar(f, rng) for _ in range(min(n, 200))]
            del value[:]
            value.extend(values)
        else:
            setattr(msg, f.name, scalar(f, rng))


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """Flip, cut, insert or repeat bytes of a valid message."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        if op == 0 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 8))
        else:
            b += bytes(b)
    return bytes(b)


@dataclass
class Tally:
    """What the fuzz saw: status codes per service, and the calls that broke a rule."""

    codes: Counter = field(default_factory=Counter)
    by_method: Counter = field(default_factory=Counter)  # (service, method, code)
    bad: list = field(default_factory=list)  # (method, code, details, payload head)
    calls: int = 0

    def ok(self, service: str, method: str) -> int:
        return self.by_method[(service, method, "OK")]

    def add(self, service: str, method: str, code: str, details: str, payload: bytes) -> None:
        self.calls += 1
        self.codes[f"{service} {code}"] += 1
        self.by_method[(service, method, code)] += 1
        if code not in ALLOWED:
            self.bad.append((method, code, details[:300], payload[:80]))


def send(channel: grpc.Channel, method: str, payload: bytes, streaming: bool, deadline_s: float,
         max_chunks: int = 6) -> tuple[str, str]:
    """One raw call (identity serializers) with a deadline: its status code name and details.
    A stream is read for ``max_chunks`` chunks, then cancelled by the fuzz: an OK call."""
    try:
        if not streaming:
            channel.unary_unary(method, request_serializer=None, response_deserializer=None)(
                payload, timeout=deadline_s)
            return "OK", ""
        call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)(
            payload, timeout=deadline_s)
        for i, _ in enumerate(call):
            if i + 1 >= max_chunks:
                call.cancel()
                return "OK", f"cancelled by the fuzz after {max_chunks} chunks"
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""
