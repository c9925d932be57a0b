"""Training data: tokenize once into a memory-mapped cache, then batches as a pure function.

Sources: plain text files, or JSONL with a `text` field or chat `messages`; a file or a directory of
them. With no path, a built-in corpus made of text already on the machine (the Python standard
library's sources and licence), so nothing is downloaded. Tokenizer: bytes by default, or a
`tokenizer.json` through the `tokenizers` package.

Each rank's batch for a data position is a pure function of (seed, data_position, rank, micro-step), so
a rollback resumes (or skips) a data window exactly, and a fresh run from a checkpoint sees the same data.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from vigil.errors import SpecError
from vigil.identity import first_position
from vigil.paths import OutsideRoots, private_dir, within
from vigil.spec import DataSpec

BUILTIN_MAX_BYTES = 4 * 1024 * 1024
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot: int  # separates documents

    def encode(self, text: str) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes are the tokens; byte 0 (never in text) separates documents."""

    name = "bytes"
    vocab_size = 256
    eot = 0

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)


class FileTokenizer:
    """A `tokenizer.json` (Hugging Face `tokenizers` format)."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer  # optional dependency
        except ImportError as exc:
            raise SpecError(
                [
                    {
                        "field": "data.tokenizer",
                        "message": "needs the `tokenizers` package: pip install tokenizers",
                    }
                ]
            ) from exc
        if not path.is_file():
            raise SpecError([{"field": "data.tokenizer", "message": f"{path} is not a file"}])
        self._tok = HFTokenizer.from_file(str(path))
        self.name = "file:" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        found = [self._tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>")]
        eot = next((i for i in found if i is not None), None)
        self.eot = eot if eot is not None else 0

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)


def load_tokenizer(spec: DataSpec, roots: Sequence[Path]) -> Tokenizer:
    return (
        FileTokenizer(confined(spec.tokenizer, roots, "data.tokenizer"))
        if spec.tokenizer
        else ByteTokenizer()
    )


def confined(path: str | Path, roots: Sequence[Path], field: str) -> Path:
    """A spec's path, resolved, if it lies under an allowed root (`vigil.paths.within`)."""
    try:
        return within(path, roots)
    except OutsideRoots as exc:
        raise _error(field, str(exc)) from exc


def _error(field: str, message: str) -> SpecError:
    return SpecError([{"field": field, "message": message}])


# --- sources ------------------------------------------------------------------------------------------


def builtin_corpus_files() -> list[Path]:
    """The standard library's top-level modules and licence: text every Python install has."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    licence = stdlib / "LICENSE.txt"
    chosen, total = ([licence], licence.stat().st_size) if licence.is_file() else ([], 0)
    for p in files:
        if total >= BUILTIN_MAX_BYTES:
            break
        chosen.append(p)
        total += p.stat().st_size
    return chosen


def source_files(spec: DataSpec, roots: Sequence[Path]) -> list[Path]:
    """The files a spec's data names, each confined to `roots` (a link inside a folder may not lead out)."""
    if spec.path is None:
        return builtin_corpus_files()
    root = confined(spec.path, roots, "data.path")
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise SpecError([{"field": "data.path", "message": f"{root} is neither a file nor a directory"}])
    suffixes = JSONL_SUFFIXES if spec.format == "jsonl" else TEXT_SUFFIXES
    files = sorted(
        confined(p, roots, "data.path") for p in root.rglob("*") if p.is_file() and p.suffix in suffixes
    )
    if not files:
        raise SpecError([{"field": "data.path", "message": f"no {'/'.join(suffixes)} files under {root}"}])
    return files


def render_chat(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)


def documents(path: Path, fmt: str) -> Iterator[str]:
    """The documents in one file: the whole file for text, one per line for JSONL."""
    if fmt == "text":
        yield path.read_text(encoding="utf-8", errors="replace")
        return
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecError(
                    [{"field": "data.path", "message": f"{path}:{lineno}: not JSON ({exc})"}]
                ) from exc
            if isinstance(row, dict) and isinstance(row.get("text"), str):
                yield row["text"]
            elif isinstance(row, dict) and isinstance(row.get("messages"), list):
                msgs = row["messages"]
                if not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in msgs):
                    raise SpecError(
                        [
                            {
                                "field": "data.path",
                                "message": f"{path}:{lineno}: each message needs role and content",
                            }
                        ]
                    )
                yield render_chat(msgs)
            else:
                raise SpecError(
                    [
                        {
                            "field": "data.path",
                            "message": f"{path}:{lineno}: needs a `text` string or `messages` list",
                        }
                    ]
                )


# --- cache --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenCache:
    path: Path
    tokens: np.ndarray  # memory-mapped, uint16 or uint32
    key: str

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def cache_key(spec: DataSpec, tok: Tokenizer, files: list[Path]) -> str:
    h = hashlib.sha256(f"v1|{tok.name}|{spec.format if spec.path else 'text'}".encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def load_tokens(spec: DataSpec, cache_dir: Path, *, vocab_size: int, roots: Sequence[Path]) -> TokenCache:
    """Tokenize the sources once into `cache_dir/<key>.<dtype>.bin`.

    `spec.path` and `spec.tokenizer` must lie under one of `roots`. The cache folder is 0700 and its
    files 0600: they hold the data. The file appears by atomic rename; a file lock keeps ranks from
    tokenizing the same sources twice.
    """
    tok = load_tokenizer(spec, roots)
    if tok.vocab_size > vocab_size:
        raise _error(
            "model.vocab_size",
            f"the tokenizer has {tok.vocab_size} tokens, more than model.vocab_size ({vocab_size})",
        )
    files = source_files(spec, roots)
    fmt = spec.format if spec.path else "text"
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    private_dir(cache_dir)
    key = cache_key(spec, tok, files)
    path = cache_dir / f"{key}.{np.dtype(dtype).name}.bin"
    with os.fdopen(os.open(cache_dir / f"{key}.lock", os.O_WRONLY | os.O_CREAT, 0o600), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one rank tokenizes; the others wait, then read its file
        if not path.exists():
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
                for f in files:
                    for doc in documents(f, fmt):
                        out.write(tok.encode(doc).astype(dtype).tobytes())
                        out.write(np.array([tok.eot], dtype=dtype).tobytes())
            os.replace(tmp, path)
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return TokenCache(path=path, tokens=tokens, key=key)


# --- batches ------------------------------------------------------------------------------------------


def batch(
    tokens: np.ndarray,
    *,
    seed: int,
    data_position: int,
    rank: int,
    micro: int,
    micro_batch: int,
    seq_len: int,
    part: int = 0,
    parts: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, each (micro_batch // parts, seq_len) int64: a pure function of its arguments.

    `micro_batch` is the spec's; a micro-step split into `parts` (after an out-of-memory) reads rows
    [part * micro_batch // parts, (part + 1) * micro_batch // parts) of the same batch, so the parts
    together are exactly the tokens the whole micro-step would have read."""
    n = tokens.shape[0]
    if n < seq_len + 2:
        raise SpecError([{"field": "data.path", "message": f"{n} tokens is fewer than model.seq_len + 2"}])
    if micro_batch % parts or not 0 <= part < parts:
        raise ValueError(f"cannot take part {part} of {parts} of a micro-batch of {micro_batch}")
    rng = np.random.default_rng((seed, data_position, rank, micro))
    rows_per_part = micro_batch // parts
    starts = rng.integers(0, n - seq_len - 1, size=micro_batch)
    starts = starts[part * rows_per_part : (part + 1) * rows_per_part]
    rows = np.stack([tokens[s : s + seq_len + 1].astype(np.int64) for s in starts])  # (B, T + 1)
    block = torch.from_numpy(rows)
    return block[:, :-1], block[:, 1:]


def next_position(position: int, skip_windows: list[tuple[int, int]]) -> int:
    """The data position after `position`, past every [start, end) window it lands in."""
    return first_position(position + 1, skip_windows)
