"""ADED's tri-gram matrix: ``P(w3 | w1, w2)`` from a corpus, plus adaptive overlays.

The *base* matrix is built once, offline, from a corpus tokenised with the
target's tokenizer, and shared read-only by every request of every worker,
as memory-mapped CSR-style numpy arrays:

* ``keys.npy``       int64, sorted: ``w1 * vocab_size + w2``
* ``offsets.npy``    int64: successors of ``keys[i]`` are ``offsets[i]:offsets[i + 1]``
* ``successors.npy`` int32, per key most probable first
* ``probs.npy``      float32, ``count(w1 w2 w3) / count(w1 w2 *)``, top ``top_k`` kept
* ``meta.json``      tokenizer identity, ``top_k`` and the build statistics

*Adaptive update*: tri-grams a request commits gain ``step`` each time, up to
``cap`` (:data:`DEFAULT_ADAPT_CAP`: a successor the corpus is sure of still
outweighs one seen a dozen times), in an :class:`Overlay` per request (or one
shared), merged with the base at lookup time, the base scaled by the
request's ``corpus_weight``; the base is never written. Lookups are batched.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from vllm_specbeam.core.corpus import (
    BATCH_CHARS,
    DEFAULT_JSONL_FIELDS,
    SourceStats,
    add_build_arguments,
    corpus_files,
    load_tokenizer,
    token_documents,
    tokenizer_identity,
)
from vllm_specbeam.methods.aded.mcts import SuccessorTable

FORMAT_VERSION = 1
DEFAULT_TOP_K = 12
DEFAULT_ADAPT_STEP = 0.04
DEFAULT_ADAPT_CAP = 0.5
ARRAYS = ("keys", "offsets", "successors", "probs")
META_FILE = "meta.json"
#: pending tri-gram codes reduced to (unique, count) once they reach this many
REDUCE_CODES = 1 << 23


class TokenizerMismatchError(ValueError):
    """The matrix was built with another vocabulary than the target's."""


# ---------------------------------------------------------------- overlays
def _key(w1: int, w2: int) -> int:
    """Overlay key: independent of any vocabulary size, so no matrix is needed."""
    return (int(w1) << 32) | int(w2)


@dataclass
class Overlay:
    """Adaptive weight gains ``key -> {successor: gain}`` for one request (or all)."""

    gains: dict[int, dict[int, float]] = field(default_factory=dict)

    def observe(self, tokens: Sequence[int] | np.ndarray, step: float, cap: float) -> None:
        """Every tri-gram inside ``tokens`` gains ``step`` per occurrence, up to ``cap``."""
        ids = np.asarray(tokens, dtype=np.int64).tolist()
        if len(ids) < 3 or step <= 0:
            return
        # sorted, so successors enter in token order (ties in probability break by it); a
        # Counter, not np.unique(axis=0), whose set-up outweighs the few tokens a step adds
        for (w1, w2, w3), count in sorted(Counter(zip(ids, ids[1:], ids[2:])).items()):
            successors = self.gains.setdefault(_key(w1, w2), {})
            successors[w3] = min(cap, successors.get(w3, 0.0) + step * count)

    def get(self, w1: int, w2: int) -> dict[int, float]:
        return self.gains.get(_key(w1, w2), {})

    def __len__(self) -> int:
        return len(self.gains)


# ---------------------------------------------------------------- the matrix
@dataclass(frozen=True)
class Continuations:
    """What :meth:`TrigramMatrix.lookup` proposes after each state, and from which source."""

    table: SuccessorTable
    #: [states, top_k] bool: the corpus's (weighted) share of the successor is larger than the overlays'
    from_corpus: np.ndarray


@dataclass(frozen=True)
class TrigramMatrix:
    """Read-only top-k tri-gram probabilities (see the module docstring for the layout)."""

    keys: np.ndarray
    offsets: np.ndarray
    successors: np.ndarray
    probs: np.ndarray
    vocab_size: int
    top_k: int = DEFAULT_TOP_K
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def empty(cls, top_k: int = DEFAULT_TOP_K) -> TrigramMatrix:
        """No corpus: every lookup is answered by the overlays alone."""
        no_keys = np.zeros(0, np.int64)
        return cls(no_keys, np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32), 0, top_k)

    @classmethod
    def from_counts(
        cls, codes: np.ndarray, counts: np.ndarray, vocab_size: int, top_k: int = DEFAULT_TOP_K
    ) -> TrigramMatrix:
        """From sorted unique tri-gram codes ``(w1 * V + w2) * V + w3`` and their counts."""
        return cls(*_select_top_k(codes, counts, vocab_size, top_k)[:4], vocab_size, top_k)

    def base(self, w1: int, w2: int) -> tuple[np.ndarray, np.ndarray]:
        """The corpus successors of ``(w1, w2)``, most probable first."""
        tokens, probs, counts = self.base_rows(np.array([[w1, w2]]))
        return tokens[0, : counts[0]], probs[0, : counts[0]]

    def base_rows(self, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The corpus successors of every ``(w1, w2)`` of ``pairs`` ([n, 2]) as padded rows:
        tokens ``[n, top_k]``, probabilities ``[n, top_k]`` (0 past a row's count), counts ``[n]``."""
        tokens = np.zeros((len(pairs), self.top_k), np.int64)
        probs = np.zeros((len(pairs), self.top_k))
        if not self.keys.size:
            return tokens, probs, np.zeros(len(pairs), np.int64)
        keys, offsets = np.asarray(self.keys), np.asarray(self.offsets)  # plain arrays: no memmap overhead
        inside = np.all((pairs >= 0) & (pairs < self.vocab_size), axis=1)  # [n]
        codes = np.where(inside, pairs[:, 0] * self.vocab_size + pairs[:, 1], -1)  # [n]
        at = np.minimum(np.searchsorted(keys, codes), keys.size - 1)  # [n]
        found = inside & (keys[at] == codes)  # [n]
        start = np.where(found, offsets[at], 0)  # [n]
        counts = np.where(found, offsets[at + 1] - start, 0)  # [n]
        present = np.arange(self.top_k) < counts[:, None]  # [n, top_k]
        entries = (start[:, None] + np.arange(self.top_k))[present]  # [present entries]
        tokens[present] = np.asarray(self.successors)[entries]
        probs[present] = np.asarray(self.probs)[entries]
        return tokens, probs, counts

    def lookup(
        self,
        pairs: np.ndarray,
        overlays: Iterable[Overlay] = (),
        cap: float = DEFAULT_ADAPT_CAP,
        corpus_weight: float = 1.0,
    ) -> Continuations:
        """Successors of every ``(w1, w2)`` of ``pairs`` ([n, 2]): the base, times
        ``corpus_weight``, merged with the overlays.

        A successor's weight is ``corpus_weight`` times its base probability
        plus its overlay gains (summed over overlays, at most ``cap``); weights
        are divided by their sum when that exceeds 1, so they stay a
        (sub-)distribution. At most ``top_k`` successors, most probable first,
        each marked with the source of its larger share. Example: base
        ``{c: 0.6}``, a gain ``{d: 0.08}`` and ``corpus_weight`` 0.1 give
        ``d: 0.08`` (context) before ``c: 0.06`` (corpus). The base part is
        one vectorised gather; only states with overlay gains are merged one by one.
        """
        pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
        tokens, probs, counts = self.base_rows(pairs)  # [n, top_k], [n, top_k], [n]
        probs *= corpus_weight
        from_corpus = np.arange(self.top_k) < counts[:, None]  # [n, top_k]
        overlays = tuple(overlays)
        for i, key in enumerate(((pairs[:, 0] << 32) | pairs[:, 1]).tolist()):  # overlay keys, as _key
            gains: dict[int, float] = {}
            for overlay in overlays:
                for token, gain in overlay.gains.get(key, {}).items():
                    gains[token] = gains.get(token, 0.0) + gain
            if gains:
                counts[i] = self._merge(i, gains, cap, tokens, probs, from_corpus, int(counts[i]))
        probs /= np.maximum(1.0, probs.sum(axis=1))[:, None]
        return Continuations(SuccessorTable(tokens, probs, counts), from_corpus)

    def _merge(
        self,
        i: int,
        gains: dict[int, float],
        cap: float,
        tokens: np.ndarray,
        probs: np.ndarray,
        from_corpus: np.ndarray,
        count: int,
    ) -> int:
        """Row ``i``'s base successors merged with its overlay gains, in place; the new count."""
        corpus = dict(zip(tokens[i, :count].tolist(), probs[i, :count].tolist(), strict=True))
        context = {token: min(cap, gain) for token, gain in gains.items()}
        ids = list(corpus | context)
        shares = np.array([[corpus.get(t, 0.0), context.get(t, 0.0)] for t in ids])  # [k, 2]
        order = np.argsort(-shares.sum(axis=1), kind="stable")[: self.top_k]
        n = order.size
        tokens[i, :n] = np.asarray(ids, np.int64)[order]
        probs[i, :n] = shares[order].sum(axis=1)
        from_corpus[i, :n] = shares[order, 0] > shares[order, 1]
        return n

    @property
    def num_keys(self) -> int:
        return int(self.keys.size)

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(self, name).nbytes) for name in ARRAYS)

    def save(self, out: str | Path) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for name in ARRAYS:
            np.save(out / f"{name}.npy", np.ascontiguousarray(getattr(self, name)))
        meta = {**self.meta, "format": FORMAT_VERSION, "vocab_size": self.vocab_size, "top_k": self.top_k}
        (out / META_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")


def read_meta(path: str | Path) -> dict[str, Any]:
    meta_file = Path(path) / META_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(
            f"{path} is not a tri-gram matrix directory (no {META_FILE}); build one with "
            f"`vllm-specbeam trigram build --tokenizer TARGET_TOKENIZER --out {path} FILES...`"
        )
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: tri-gram matrix format {meta.get('format')}, this version reads {FORMAT_VERSION}; rebuild it"
        )
    return meta


def load(path: str | Path, tokenizer: Any) -> TrigramMatrix:
    """Memory-map a saved matrix, refusing one built with another vocabulary.

    ``tokenizer`` is the target's tokenizer (or its name/path); the check
    compares vocabulary size and hash, and ignores the name.
    """
    meta = read_meta(path)
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(str(tokenizer))
    built, target = meta["tokenizer"], tokenizer_identity(tokenizer)
    if (built["vocab_size"], built["vocab_hash"]) != (target["vocab_size"], target["vocab_hash"]):
        raise TokenizerMismatchError(
            f"tri-gram matrix {path} was built with tokenizer {built['name']!r} (vocab size {built['vocab_size']}, "
            f"hash {built['vocab_hash'][:12]}), but the target uses tokenizer {target['name']!r} (vocab size "
            f"{target['vocab_size']}, hash {target['vocab_hash'][:12]}); rebuild the matrix with the target's "
            f"tokenizer: vllm-specbeam trigram build --tokenizer {target['name']} --out {path} FILES..."
        )
    arrays = {name: np.load(Path(path) / f"{name}.npy", mmap_mode="r") for name in ARRAYS}
    return TrigramMatrix(**arrays, vocab_size=meta["vocab_size"], top_k=meta["top_k"], meta=meta)


# ---------------------------------------------------------------- building
class TrigramCounter:
    """Exact tri-gram counts of a token stream, in bounded-growth numpy arrays.

    Codes ``(w1 * V + w2) * V + w3`` are buffered and, once the buffer is as
    large as the running table (and at least :data:`REDUCE_CODES`), merged into
    a sorted ``(unique codes, counts)`` table: amortised ``O(n log n)`` with no
    Python loop per token.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size**3 >= 2**63:
            raise ValueError(f"vocab size {vocab_size} is too large for int64 tri-gram codes")
        self.vocab_size = vocab_size
        self.tokens = 0
        self.codes = np.zeros(0, np.int64)
        self.counts = np.zeros(0, np.int64)
        self._pending: list[np.ndarray] = []
        self._pending_size = 0

    def add(self, ids: Sequence[int] | np.ndarray) -> None:
        seq = np.asarray(ids, np.int64)
        self.tokens += seq.size
        if seq.size < 3:
            return
        v = self.vocab_size
        self._pending.append((seq[:-2] * v + seq[1:-1]) * v + seq[2:])
        self._pending_size += seq.size - 2
        if self._pending_size >= max(REDUCE_CODES, self.codes.size):
            self._reduce()

    def _reduce(self) -> None:
        if not self._pending:
            return
        new, new_counts = np.unique(np.concatenate(self._pending), return_counts=True)
        codes = np.concatenate([self.codes, new])
        counts = np.concatenate([self.counts, new_counts])
        order = np.argsort(codes, kind="stable")
        codes, counts = codes[order], counts[order]
        starts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
        self.codes, self.counts = codes[starts], np.add.reduceat(counts, starts)
        self._pending, self._pending_size = [], 0

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        self._reduce()
        return self.codes, self.counts


def build(
    paths: Iterable[str | Path],
    tokenizer: Any,
    top_k: int = DEFAULT_TOP_K,
    fields: Sequence[str] = DEFAULT_JSONL_FIELDS,
    batch_chars: int = BATCH_CHARS,
    progress: bool = True,
    exclude: Sequence[str] = (),
) -> TrigramMatrix:
    """Count a corpus's tri-grams with ``tokenizer`` and keep the top ``top_k`` per key.

    The returned matrix carries the tokenizer identity and build statistics
    in ``meta`` (see :func:`format_report`); ``exclude`` as in :func:`corpus_files`.
    """
    files = corpus_files(paths, exclude)
    stats = SourceStats()
    counter = TrigramCounter(len(tokenizer))
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="tri-grams", disable=not progress) as bar:
        for ids in token_documents(files, tokenizer, fields, stats, bar, batch_chars):
            counter.add(ids)
            bar.set_postfix(tokens=counter.tokens, refresh=False)
    codes, counts = counter.finish()
    keys, offsets, successors, probs, kept = _select_top_k(codes, counts, counter.vocab_size, top_k)
    total_trigrams = int(counts.sum())
    meta = {
        "tokenizer": tokenizer_identity(tokenizer),
        "top_k": top_k,
        "sources": {
            "files": stats.files,
            "documents": stats.documents,
            "bytes": total,
            "jsonl_fields": stats.jsonl_fields,
            "jsonl_skipped": stats.jsonl_skipped,
            "jsonl_field_order": list(fields),
        },
        "stats": {
            "tokens": counter.tokens,
            "trigrams": total_trigrams,
            "distinct_trigrams": int(codes.size),
            "keys": int(keys.size),
            "entries": int(successors.size),
            "kept_mass": kept / max(1, total_trigrams),
            "vocab_seen": np.unique(successors).size / counter.vocab_size,
            "array_bytes": sum(int(a.nbytes) for a in (keys, offsets, successors, probs)),
        },
    }
    return TrigramMatrix(keys, offsets, successors, probs, counter.vocab_size, top_k, meta)


def _select_top_k(
    codes: np.ndarray, counts: np.ndarray, vocab_size: int, top_k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """CSR arrays of the ``top_k`` most frequent successors per key, and their total count.

    Probabilities are normalised by the key's full count, not the kept one:
    they are the corpus's ``P(w3 | w1, w2)``.
    """
    codes = np.asarray(codes, np.int64)
    counts = np.asarray(counts, np.int64)
    pair = codes // vocab_size
    starts = np.flatnonzero(np.r_[True, pair[1:] != pair[:-1]]) if codes.size else np.zeros(0, np.int64)
    totals = np.add.reduceat(counts, starts) if codes.size else np.zeros(0, np.int64)
    group = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, codes.size]))
    order = np.lexsort((codes, -counts, pair))  # per key: most frequent first, then lowest id
    kept = order[np.arange(codes.size) - starts[group[order]] < top_k]
    offsets = np.r_[0, np.cumsum(np.bincount(group[kept], minlength=starts.size))].astype(np.int64)
    successors = (codes[kept] % vocab_size).astype(np.int32)
    probs = (counts[kept] / totals[group[kept]]).astype(np.float32)
    return pair[starts], offsets, successors, probs, int(counts[kept].sum())


def format_report(meta: dict[str, Any], path: str | Path | None = None) -> str:
    """Size and coverage of a matrix, for ``build`` and ``info``."""
    tok, src, st = meta["tokenizer"], meta["sources"], meta["stats"]
    fields = ", ".join(f"{k}: {v}" for k, v in src["jsonl_fields"].items()) or "none"
    lines = [
        *([f"matrix      {path}"] if path else []),
        f"tokenizer   {tok['name']} (vocab {tok['vocab_size']}, hash {tok['vocab_hash'][:12]})",
        f"corpus      {src['files']} files, {src['documents']} documents, {src['bytes'] / 1e6:.1f} MB; "
        f"jsonl records by field ({'/'.join(src['jsonl_field_order'])}, first present): {fields}; "
        f"skipped {src['jsonl_skipped']}",
        f"counted     {st['tokens']} tokens, {st['trigrams']} tri-grams, {st['distinct_trigrams']} distinct",
        f"kept        top {meta['top_k']}: {st['keys']} keys, {st['entries']} entries, "
        f"{st['array_bytes'] / 1e6:.1f} MB of arrays",
        f"coverage    {st['kept_mass']:.1%} of corpus tri-grams are kept entries; "
        f"{st['vocab_seen']:.1%} of the vocabulary occurs as a kept successor",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- command line
def main(argv: Sequence[str] | None = None) -> int:
    """``vllm-specbeam trigram build|info``: build a matrix or describe one."""
    parser = argparse.ArgumentParser(prog="vllm-specbeam trigram", description="ADED tri-gram matrices")
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="count a corpus's tri-grams with the target's tokenizer")
    add_build_arguments(build_cmd, "matrix")
    build_cmd.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="successors kept per (w1, w2) key")
    build_cmd.add_argument(
        "--jsonl-fields",
        default=",".join(DEFAULT_JSONL_FIELDS),
        help="jsonl: fields tried in order, the first holding a string is the document",
    )
    info_cmd = commands.add_parser("info", help="show a matrix's tokenizer, size and coverage")
    info_cmd.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            if args.top_k < 1:
                parser.error("--top-k must be at least 1")
            matrix = build(
                args.files,
                load_tokenizer(args.tokenizer),
                args.top_k,
                tuple(f for f in args.jsonl_fields.split(",") if f),
                progress=not args.no_progress,
                exclude=args.exclude,
            )
            matrix.save(args.out)
            print(format_report(matrix.meta, args.out))
        else:
            print(format_report(read_meta(args.path), args.path))
    except (OSError, ValueError) as error:
        print(f"vllm-specbeam trigram: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
