"""Reading a text corpus and tokenising it: shared by every command that counts tokens.

``aded``'s tri-gram matrix (``vllm-specbeam trigram build``) and the draft
vocabulary of the draft-model methods (``vllm-specbeam draft-vocab build``)
are both counted from files given on the command line: plain text, Python,
Markdown and JSONL (gzip read transparently), streamed in bounded batches.
A tokenizer's *identity* (a hash of its vocabulary) is stored with what was
built, so a file built for one vocabulary is refused by another.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import io
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

#: jsonl fields tried in this order; the first one holding a string is used
DEFAULT_JSONL_FIELDS = ("text", "content", "prompt")
TEXT_SUFFIXES = (".txt", ".py", ".md", ".jsonl")
#: text files are cut (at line ends) into documents of about this many characters
DOC_CHARS = 1 << 16
#: characters tokenised per batch
BATCH_CHARS = 1 << 20


def add_build_arguments(command: argparse.ArgumentParser, built: str) -> None:
    """The arguments every corpus-counting ``build`` command takes: tokenizer, output, corpus files."""
    command.add_argument("--tokenizer", required=True, help="the target model's tokenizer (directory or name)")
    command.add_argument("--out", required=True, help=f"directory to write the {built} to")
    command.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="skip files under a directory argument whose relative path matches (fnmatch; repeatable), "
        "e.g. '*/tests/*'",
    )
    command.add_argument("--no-progress", action="store_true", help="no progress bar")
    command.add_argument("files", nargs="+", help=f"files or directories ({', '.join(TEXT_SUFFIXES)}, also .gz)")


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """Name, size and a hash of the vocabulary: the hash is what decides a match.

    Names differ between a hub name and a local copy of the same tokenizer;
    the ``(token, id)`` pairs do not.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    return {"name": str(tokenizer.name_or_path), "vocab_size": len(tokenizer), "vocab_hash": digest}


def load_tokenizer(name_or_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


@dataclass
class SourceStats:
    """What the corpus reader took from where: shown to the user after a build."""

    files: int = 0
    documents: int = 0
    jsonl_fields: dict[str, int] = field(default_factory=dict)
    jsonl_skipped: int = 0


def corpus_files(paths: Iterable[str | Path], exclude: Sequence[str] = ()) -> list[Path]:
    """The files to read: the given files, and the text files under given
    directories whose path relative to that directory matches none of the
    ``exclude`` globs (``fnmatch``, where ``*`` also crosses ``/``: e.g.
    ``*/tests/*`` or ``site-packages/*`` to keep a source tree's tests or
    third-party code out of the corpus)."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and _suffix(p) in TEXT_SUFFIXES
                and not any(fnmatch.fnmatch(p.relative_to(path).as_posix(), g) for g in exclude)
            )
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"corpus path {path} does not exist")
    return files


def _suffix(path: Path) -> str:
    """``.jsonl`` for ``x.jsonl.gz`` too: gzip is read transparently."""
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


def iter_documents(files: Sequence[Path], fields: Sequence[str], stats: SourceStats, progress: tqdm) -> Iterator[str]:
    """Documents of the corpus; tri-grams never span two documents.

    jsonl: one document per record, the first of ``fields`` that holds a
    string. Other files: the whole file, cut at line ends every ~64K chars so
    a single huge file streams instead of being read at once.
    """
    for path in files:
        stats.files += 1
        with open(path, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw
            lines = _tracked_lines(stream, raw, progress)
            is_jsonl = _suffix(path) == ".jsonl"
            documents = _jsonl_documents(lines, fields, stats, path) if is_jsonl else _text_documents(lines)
            for document in documents:
                stats.documents += 1
                yield document


def _tracked_lines(stream: io.IOBase, raw: io.IOBase, progress: tqdm) -> Iterator[str]:
    """Decoded lines, advancing the progress bar by the (compressed) bytes read."""
    position = 0
    for line in stream:
        now = raw.tell()
        progress.update(now - position)
        position = now
        yield line.decode("utf-8", errors="replace")


def _text_documents(lines: Iterable[str]) -> Iterator[str]:
    return ("".join(chunk) for chunk in _chunks(lines, DOC_CHARS))


def _jsonl_documents(lines: Iterable[str], fields: Sequence[str], stats: SourceStats, path: Path) -> Iterator[str]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not a JSON record ({error.msg})") from None
        name = next((f for f in fields if isinstance(record, dict) and isinstance(record.get(f), str)), None)
        if name is None:
            stats.jsonl_skipped += 1
            continue
        stats.jsonl_fields[name] = stats.jsonl_fields.get(name, 0) + 1
        yield record[name]


def _chunks(texts: Iterable[str], chars: int) -> Iterator[list[str]]:
    """Consecutive texts grouped until a group holds at least ``chars`` characters."""
    chunk: list[str] = []
    size = 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def token_documents(
    files: Sequence[Path],
    tokenizer: Any,
    fields: Sequence[str],
    stats: SourceStats,
    progress: tqdm,
    batch_chars: int = BATCH_CHARS,
) -> Iterator[list[int]]:
    """The token ids of each document of ``files`` (no special tokens), tokenised in batches."""
    for batch in _chunks(iter_documents(files, fields, stats, progress), batch_chars):
        encoded = tokenizer(batch, add_special_tokens=False, return_attention_mask=False, verbose=False)
        yield from encoded["input_ids"]
