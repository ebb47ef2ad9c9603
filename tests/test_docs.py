"""The docs say what the code does: generated pages are current, every code
block in the README and the docs pages parses, every speculative config in
them passes the options table, and every relative link resolves.

Fast: no engine, no vLLM import.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from vllm_specbeam import docs_pages
from vllm_specbeam.adapter import patches
from vllm_specbeam.core import config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
#: the pages users read: README and docs/, not the dated archive
PAGES = [README, *sorted(DOCS.glob("*.md")), *sorted(DOCS.glob("methods/*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SPEC_FLAG = re.compile(r"--speculative-config\s+'([^']*)'")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block."""
    return [(match.group(1), match.group(2)) for match in FENCE.finditer(text)]


def speculative_configs(language: str, code: str) -> list[dict[str, Any]]:
    """The speculative configs a code block names: ``--speculative-config '{...}'``
    in shell, ``speculative_config={...}`` in Python, a JSON object with a ``method``."""
    if language == "bash":
        return [json.loads(found) for found in SPEC_FLAG.findall(code)]
    if language == "python":
        return [
            ast.literal_eval(keyword.value)
            for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Call)
            for keyword in node.keywords
            if keyword.arg == "speculative_config" and isinstance(keyword.value, ast.Dict)
        ]
    if language == "json":
        data = json.loads(code)
        return [data] if isinstance(data, dict) and "method" in data else []
    return []


def config_problems(spec: dict[str, Any]) -> list[str]:
    """What the options table says is wrong with ``spec`` (without loading models or files)."""
    name = spec.get("method")
    if name not in config.METHODS:
        return [f"unknown method {name!r}; the plugin's: {sorted(config.METHODS)}"]
    method = config.METHODS[name]
    options = method.options()
    problems = [f"{name}: unknown option {key!r}" for key in spec if key not in options and key not in config.VLLM_KEYS]
    if method.needs_draft_model != ("model" in spec):
        problems.append(f"{name}: a draft model is {'required' if method.needs_draft_model else 'refused'}")
    for key, value in spec.items():
        if key in options:
            try:
                options[key].check(key, value)
            except config.SpecbeamConfigError as error:
                problems.append(f"{name}: {error}")
    return problems


def page_problems(path: Path, root: Path = ROOT) -> list[str]:
    """Every code block of one page that does not parse, or names a config the table refuses."""
    problems = []
    for index, (language, code) in enumerate(code_blocks(path.read_text())):
        where = f"{path.relative_to(root)} block {index + 1} ({language or 'plain'})"
        if language == "python":
            try:
                ast.parse(code)
            except SyntaxError as error:
                problems.append(f"{where}: {error}")
                continue
        elif language == "bash":
            result = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
            if result.returncode:
                problems.append(f"{where}: {result.stderr.strip()}")
                continue
        try:
            specs = speculative_configs(language, code)
        except (ValueError, SyntaxError) as error:
            problems.append(f"{where}: a speculative config that is not a literal: {error}")
            continue
        problems += [f"{where}: {problem}" for spec in specs for problem in config_problems(spec)]
    return problems


@pytest.mark.parametrize("path", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_code_blocks_parse_and_their_configs_pass_the_options_table(path):
    assert not page_problems(path)


def test_the_readme_shows_every_method_with_a_config():
    named = {
        spec["method"]
        for language, code in code_blocks(README.read_text())
        for spec in speculative_configs(language, code)
    }
    assert named == set(config.METHODS)


def test_the_block_check_catches_a_planted_unknown_option(tmp_path):
    page = tmp_path / "README.md"
    page.write_text(
        "```python\nLLM('m', speculative_config={'method': 'lookup_tree', 'max_node': 8})\n```\n"
        '```bash\nvllm serve M --speculative-config \'{"method": "aded", "num_speculative_tokens": 99}\'\n```\n'
        "```bash\nif then\n```\n"
    )
    problems = [problem.split(": ", 1)[1] for problem in page_problems(page, tmp_path)]
    assert problems == [
        "lookup_tree: unknown option 'max_node'",
        "aded: option 'num_speculative_tokens' must be in [1, 32], got 99",
        problems[2],
    ]
    assert "syntax error" in problems[2]


def test_the_readme_is_a_short_guide_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 220
    commands = [
        line.split("#")[0].strip()
        for language, code in code_blocks(text)
        if "make bench" in code
        for line in code.splitlines()
    ]
    assert commands == ["make bench", "make test"]


@pytest.mark.parametrize("path", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(path):
    targets = [link for link in LINK.findall(path.read_text()) if "://" not in link and not link.startswith("mailto:")]
    missing = [link for link in targets if not (path.parent / link).exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


def test_generated_pages_are_current():
    assert not docs_pages.stale(DOCS), f"run {docs_pages.REGENERATE}"


def test_the_options_page_check_catches_a_planted_drift(monkeypatch, tmp_path):
    for page, render in docs_pages.PAGES.items():
        (tmp_path / page).write_text(render())
    assert docs_pages.stale(tmp_path) == []
    depth = config.TREE_OPTIONS["num_speculative_tokens"]
    monkeypatch.setitem(config.TREE_OPTIONS, "num_speculative_tokens", replace(depth, default=5))
    assert docs_pages.stale(tmp_path) == ["options.md"]


def test_every_patch_target_says_why():
    assert all(target.patch > 0 and target.why for target in patches.TARGETS)


def test_module_docstrings_state_a_contract_in_a_few_lines():
    long = []
    for path in sorted((ROOT / "vllm_specbeam").rglob("*.py")):
        body = ast.parse(path.read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            lines = (body[0].end_lineno or 0) - body[0].lineno + 1
            if lines > 25:
                long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long, "module docstrings over 25 lines (history belongs in docs/, rationale in git):\n" + "\n".join(long)
