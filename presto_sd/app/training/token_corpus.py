"""The drafter corpus that lives in the repo: the target's responses as compressed token ids.

A cache does not survive a change of machine; twice the regenerated corpus was lost with it.
So what costs generation (the target's own responses) is kept in the repo as token ids,
and what costs only a prefill (the target's hidden states, its top-k logits) is recomputed
into the cache from those ids when missing (``features.py``).

Layout of a corpus folder::

    manifest.json          plan key, tokenizer, and per shard: sha256, sequences, tokens,
                           the command, dtype and CPU that made it
    shard_00000.ids.xz     one plan batch: prompt and response ids (uint16), item ids

A shard's bytes are a pure function of its content (xz of a fixed layout, no timestamps),
so the same plan on the same dtype and CPU kind writes the same file, and a resumed job
can be checked against a straight one byte for byte.

``PromptChunks`` keeps the second plan's prompts the same way (``magpie.py``): the requests
the target sampled, which no machine can draw again, as xz JSON lines with a manifest.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from presto_sd.app.errors import UsageError

MAGIC = b"PRESTO-IDS-1\n"
UINT16_MAX = 2**16 - 1


class CorpusError(UsageError, ValueError):
    """A corpus shard or manifest is malformed, or does not match the plan resuming it."""


@dataclass(frozen=True)
class IdShard:
    """One shard: per sequence its item id, prompt ids and response ids."""

    item_ids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]
    responses: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not (len(self.item_ids) == len(self.prompts) == len(self.responses)):
            # a writer's bug, not a user's input: a ValueError keeps its traceback
            raise ValueError("a shard needs one prompt and one response per item id")

    @property
    def n_tokens(self) -> int:
        return sum(len(p) + len(r) for p, r in zip(self.prompts, self.responses))

    @property
    def n_response_tokens(self) -> int:
        return sum(len(r) for r in self.responses)


def encode_shard(shard: IdShard) -> bytes:
    """A fixed byte layout, xz-compressed: header JSON line, then prompt and response ids."""
    flat = [t for p, r in zip(shard.prompts, shard.responses) for t in (*p, *r)]
    if flat and (min(flat) < 0 or max(flat) > UINT16_MAX):
        raise CorpusError(f"token ids must fit uint16 (0..{UINT16_MAX}); this vocabulary does not")
    header = {"item_ids": list(shard.item_ids), "prompt_lens": [len(p) for p in shard.prompts],
              "response_lens": [len(r) for r in shard.responses]}
    head = json.dumps(header, separators=(",", ":")).encode()
    raw = MAGIC + head + b"\n" + np.asarray(flat, "<u2").tobytes()
    return lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)


def decode_shard(data: bytes) -> IdShard:
    try:
        raw = lzma.decompress(data)
    except lzma.LZMAError as e:
        raise CorpusError(f"not an xz shard: {e}") from None
    if not raw.startswith(MAGIC):
        raise CorpusError("not a presto-sd id shard (bad magic)")
    head_end = raw.index(b"\n", len(MAGIC))
    header = json.loads(raw[len(MAGIC) : head_end])
    ids = np.frombuffer(raw[head_end + 1 :], "<u2").astype(np.int64).tolist()
    plens, rlens = header["prompt_lens"], header["response_lens"]
    if sum(plens) + sum(rlens) != len(ids):
        raise CorpusError(f"shard holds {len(ids)} ids, its header counts {sum(plens) + sum(rlens)}")
    prompts, responses, at = [], [], 0
    for p, r in zip(plens, rlens):
        prompts.append(tuple(ids[at : at + p]))
        responses.append(tuple(ids[at + p : at + p + r]))
        at += p + r
    return IdShard(tuple(header["item_ids"]), tuple(prompts), tuple(responses))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cpu_description() -> str:
    """The CPU model and whether it has native bf16: timings and bf16 bytes depend on both."""
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    return f"{model}; {'native bf16: ' + ','.join(native) if native else 'no native bf16'}"


class Corpus:
    """A corpus folder: its manifest and shards. Writes are atomic (tmp file, rename)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.manifest_path = self.root / "manifest.json"

    def manifest(self) -> dict:
        if not self.manifest_path.exists():
            return {"shards": {}}
        return json.loads(self.manifest_path.read_text())

    def shard_path(self, index: int) -> Path:
        return self.root / f"shard_{index:05d}.ids.xz"

    def has(self, index: int) -> bool:
        return self.shard_path(index).exists() and str(index) in self.manifest()["shards"]

    def open_plan(self, plan_key: dict, tokenizer: str) -> None:
        """Start a corpus for ``plan_key``, or check that the one here was made by it."""
        m = self.manifest()
        if m.get("plan_key") is None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._write_manifest({"format": "presto-ids-1", "plan_key": plan_key, "tokenizer": tokenizer,
                                  "shards": {}})
        elif m["plan_key"] != plan_key:
            raise CorpusError(f"{self.root} was made by another plan (differs in "
                              f"{_differs(m['plan_key'], plan_key)}): resume with the flags it was made "
                              "with, or give another --corpus")

    def write(self, index: int, shard: IdShard, made_by: dict) -> dict:
        """Write shard ``index`` and its manifest entry; returns the entry."""
        data = encode_shard(shard)
        path = self.shard_path(index)
        write_atomically(path, data)
        entry = {"file": path.name, "sha256": sha256_bytes(data), "bytes": len(data),
                 "sequences": len(shard.item_ids), "tokens": shard.n_tokens,
                 "response_tokens": shard.n_response_tokens, **made_by}
        m = self.manifest()
        m["shards"][str(index)] = entry
        m["totals"] = _totals(m["shards"])
        self._write_manifest(m)
        return entry

    def read(self, index: int, verify: bool = True) -> IdShard:
        """Shard ``index``, its sha256 checked against the manifest."""
        data = self.shard_path(index).read_bytes()
        entry = self.manifest()["shards"].get(str(index))
        if entry is None:
            raise CorpusError(f"shard {index} is not in {self.manifest_path}")
        if verify and sha256_bytes(data) != entry["sha256"]:
            raise CorpusError(f"{self.shard_path(index)}: sha256 differs from the manifest (edited, corrupt)")
        try:
            return decode_shard(data)
        except CorpusError as e:  # its digest matched: whatever wrote it wrote it wrong
            raise CorpusError(f"{self.shard_path(index)}: {e}") from None

    def remove(self, index: int) -> None:
        """Drop shard ``index`` and its manifest entry (the manifest first: a crash leaves an
        orphan file that the next write replaces, never an entry without its file)."""
        m = self.manifest()
        m["shards"].pop(str(index), None)
        m["totals"] = _totals(m["shards"])
        self._write_manifest(m)
        self.shard_path(index).unlink(missing_ok=True)

    def indices(self) -> list[int]:
        return sorted(int(k) for k in self.manifest()["shards"])

    def _write_manifest(self, m: dict) -> None:
        _write_json(self.manifest_path, m)


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data``, written atomically (a tmp file beside it, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")  # never another file's name (foo.jsonl -> foo.jsonl.tmp)
    tmp.write_bytes(data)
    tmp.rename(path)


def _write_json(path: Path, m: dict) -> None:
    write_atomically(path, (json.dumps(m, indent=1, sort_keys=True) + "\n").encode())


def _differs(old: dict, new: dict) -> str:
    """The keys whose values two plan keys disagree on, for a refusal's message."""
    return ", ".join(sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)))


def _totals(shards: dict) -> dict:
    return {"shards": len(shards), "sequences": sum(e["sequences"] for e in shards.values()),
            "tokens": sum(e["tokens"] for e in shards.values()),
            "response_tokens": sum(e["response_tokens"] for e in shards.values()),
            "bytes": sum(e["bytes"] for e in shards.values())}


def made_by(dtype: str, seconds: float) -> dict:
    """What a shard's manifest entry says about how it was made."""
    return {"command": " ".join(["presto-sd", *sys.argv[1:]]), "dtype": dtype, "cpu": cpu_description(),
            "seconds": round(seconds, 1), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


class PromptChunks:
    """The sampled requests in the repo: ``chunk_NNNNN.jsonl.xz`` and ``manifest.json``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.manifest_path = self.root / "manifest.json"

    def manifest(self) -> dict:
        return json.loads(self.manifest_path.read_text()) if self.manifest_path.exists() else {}

    def indices(self) -> list[int]:
        return sorted(int(i) for i in self.manifest().get("chunks", {}))

    def open(self, key: dict) -> None:
        """Start the folder for ``key``, or check that its chunks were sampled with it."""
        m = self.manifest()
        if not m:
            self.root.mkdir(parents=True, exist_ok=True)
            self._write_manifest({"format": "presto-prompts-1", "key": key, "chunks": {}})
        elif m["key"] != key:
            raise CorpusError(f"{self.root} holds requests sampled otherwise (differs in "
                              f"{_differs(m['key'], key)}): resume with the flags it was made with, "
                              "or give another --prompts")

    def write(self, index: int, requests: list[str], sampled: int, made: dict) -> None:
        data = lzma.compress("".join(json.dumps({"text": r}) + "\n" for r in requests).encode(), preset=9)
        path = self.root / f"chunk_{index:05d}.jsonl.xz"
        write_atomically(path, data)
        m = self.manifest()
        m["chunks"][str(index)] = {"file": path.name, "sha256": sha256_bytes(data),
                                   "sampled": sampled, "kept": len(requests), **made}
        m["totals"] = {"chunks": len(m["chunks"]), "requests": sum(c["kept"] for c in m["chunks"].values())}
        self._write_manifest(m)

    def read(self, index: int) -> list[str]:
        """Chunk ``index``'s requests; refuses a file whose sha256 is not the manifest's."""
        entry = self.manifest()["chunks"][str(index)]
        data = (self.root / entry["file"]).read_bytes()
        if sha256_bytes(data) != entry["sha256"]:
            raise CorpusError(f"{self.root / entry['file']}: sha256 differs from the manifest's")
        return [json.loads(line)["text"] for line in lzma.decompress(data).decode().splitlines()]

    def _write_manifest(self, m: dict) -> None:
        _write_json(self.manifest_path, m)
