"""The draft's vocabulary: the tokens a draft model scores at every forward (FR-Spec).

A small draft pays a large share of its forward for its output layer: for
Qwen2.5-Coder-0.5B (hidden 896, 151,936 tokens) the logits read 545 MB of
float32 weights per forward, 22 of its 89 ms on this CPU. Restricting the
draft's logits to the tokens a corpus uses most (Zhao et al., "FR-Spec",
arXiv 2502.14856) cuts that to the share kept; the in-worker runtime adds, per
request, every token of the request's own context, so identifiers the prompt
introduced stay draftable (on HumanEval with Qwen2.5-Coder's tokenizer: the
32,768 most frequent tokens of the Python standard library cover 97.4% of the
reference solutions' tokens, 99.3% with each request's context added).

Lossless either way: the draft proposes from its restricted distribution
``q`` (zero outside the kept tokens) and verification takes ``q`` as given;
only acceptance can drop, when the target wants a token the draft cannot
name.

A vocabulary is a directory: ``ids.npy`` (int64, sorted) and ``meta.json``
(the tokenizer's identity, the corpus, the coverage of the corpus). Built by
``vllm-specbeam draft-vocab build``; used with ``"draft_vocab": DIR``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from vllm_specbeam.core.corpus import (
    DEFAULT_JSONL_FIELDS,
    SourceStats,
    add_build_arguments,
    corpus_files,
    load_tokenizer,
    token_documents,
    tokenizer_identity,
)

FORMAT_VERSION = 1
IDS_FILE = "ids.npy"
META_FILE = "meta.json"
DEFAULT_SIZE = 32768


class DraftVocabularyError(ValueError):
    """A vocabulary directory that is missing, malformed or built for another tokenizer."""


@dataclass(frozen=True)
class DraftVocabulary:
    """Token ids the draft always scores (sorted), and how they were chosen."""

    ids: np.ndarray  # [size] int64, sorted
    meta: dict[str, Any]

    def save(self, out: str | Path) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / IDS_FILE, self.ids)
        (out / META_FILE).write_text(json.dumps({**self.meta, "format": FORMAT_VERSION}, indent=2) + "\n")
        return out

    def check_tokenizer(self, tokenizer: Any, path: str | Path) -> None:
        """Refuse a vocabulary counted with another tokenizer than ``tokenizer`` (the target's)."""
        built, target = self.meta["tokenizer"], tokenizer_identity(tokenizer)
        if (built["vocab_size"], built["vocab_hash"]) != (target["vocab_size"], target["vocab_hash"]):
            raise DraftVocabularyError(
                f"draft vocabulary {path} was built with tokenizer {built['name']!r} (vocab size "
                f"{built['vocab_size']}), but the target uses {target['name']!r} (vocab size "
                f"{target['vocab_size']}); rebuild it: vllm-specbeam draft-vocab build --tokenizer "
                f"{target['name']} --out {path} FILES..."
            )


def load(path: str | Path) -> DraftVocabulary:
    """Read a vocabulary directory, with a clear error naming how to build one."""
    path = Path(path)
    meta_file, ids_file = path / META_FILE, path / IDS_FILE
    if not meta_file.is_file() or not ids_file.is_file():
        raise DraftVocabularyError(
            f'"draft_vocab": {str(path)!r} is not a draft vocabulary directory (no {META_FILE} / {IDS_FILE}); '
            f"build one with `vllm-specbeam draft-vocab build --tokenizer TARGET --out {path} FILES...`"
        )
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise DraftVocabularyError(
            f"{path}: draft vocabulary format {meta.get('format')}, this version reads {FORMAT_VERSION}; rebuild it"
        )
    ids = np.load(ids_file).astype(np.int64)
    if ids.ndim != 1 or ids.size == 0 or np.any(np.diff(ids) <= 0) or ids[0] < 0:
        raise DraftVocabularyError(f"{path}/{IDS_FILE}: expected sorted distinct token ids; rebuild it")
    return DraftVocabulary(ids, meta)


def build(
    paths: Iterable[str | Path],
    tokenizer: Any,
    size: int = DEFAULT_SIZE,
    exclude: Sequence[str] = (),
    fields: Sequence[str] = DEFAULT_JSONL_FIELDS,
    progress: bool = True,
) -> DraftVocabulary:
    """The ``size`` tokens a corpus uses most (ties: lower id first), plus the tokenizer's special tokens.

    Special tokens (EOS among them) never occur in tokenised text but end
    most answers: they are always kept.
    """
    if size < 1:
        raise ValueError(f"size must be at least 1, got {size}")
    files = corpus_files(paths, exclude)
    stats = SourceStats()
    counts = np.zeros(len(tokenizer), np.int64)  # [vocab]
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokens", disable=not progress) as bar:
        for document in token_documents(files, tokenizer, fields, stats, bar):
            counts += np.bincount(np.asarray(document, np.int64), minlength=counts.size)
    order = np.argsort(-counts, kind="stable")[: min(size, counts.size)]
    kept = order[counts[order] > 0]
    special = np.asarray(sorted(set(tokenizer.all_special_ids)), np.int64)
    ids = np.union1d(kept, special)
    seen = int(counts.sum())
    meta = {
        "tokenizer": tokenizer_identity(tokenizer),
        "size": int(ids.size),
        "requested_size": size,
        "sources": {"files": stats.files, "documents": stats.documents, "bytes": total},
        "stats": {
            "tokens": seen,
            "distinct_tokens": int(np.count_nonzero(counts)),
            "corpus_coverage": float(counts[kept].sum() / max(1, seen)),
        },
    }
    return DraftVocabulary(ids, meta)


def format_report(vocabulary: DraftVocabulary, path: str | Path) -> str:
    meta, stats = vocabulary.meta, vocabulary.meta["stats"]
    return (
        f"draft vocabulary {path}: {meta['size']} of {meta['tokenizer']['vocab_size']} tokens "
        f"({meta['tokenizer']['name']}); corpus {meta['sources']['files']} files, {stats['tokens']} tokens, "
        f"{stats['distinct_tokens']} distinct; the kept tokens are {stats['corpus_coverage']:.1%} of the corpus's"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``vllm-specbeam draft-vocab build``: count a corpus's tokens and keep the most frequent."""
    parser = argparse.ArgumentParser(prog="vllm-specbeam draft-vocab", description="the draft model's vocabulary")
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="keep the tokens a corpus uses most")
    add_build_arguments(build_cmd, "vocabulary")
    build_cmd.add_argument("--size", type=int, default=DEFAULT_SIZE, help="tokens kept (special tokens added)")
    args = parser.parse_args(argv)
    try:
        vocabulary = build(
            args.files, load_tokenizer(args.tokenizer), args.size, args.exclude, progress=not args.no_progress
        )
        print(format_report(vocabulary, vocabulary.save(args.out)))
    except (OSError, ValueError) as error:
        print(f"vllm-specbeam draft-vocab: error: {error}", file=sys.stderr)
        return 1
    return 0
