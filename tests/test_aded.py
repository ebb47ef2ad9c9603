"""ADED: tri-gram matrix, adaptive overlays, MCTS draft trees and the drafter."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest

from vllm_specbeam.core.config import TREE_OPTIONS, SpecbeamConfigError
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.methods.aded import trigram
from vllm_specbeam.methods.aded.drafter import AdedDrafter
from vllm_specbeam.methods.aded.mcts import SearchParams, search, selection_scores

WORDS = ["[UNK]", "a", "b", "c", "d", "e", "f", "g"]


def make_tokenizer(directory: Path, words: list[str]) -> str:
    """A whitespace word-level tokenizer saved like a model's: no hub needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tokenizer(tmp_path_factory.mktemp("tok"), WORDS)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "one.txt").write_text("a b c a b d\n")
    (root / "code").mkdir()
    (root / "code" / "two.py").write_text("a b c\n")
    (root / "code" / "skip.bin").write_text("a b d a b d a b d\n")  # not a text suffix: ignored
    records = [{"text": "e f g"}, {"prompt": "e f g"}, {"content": "e f a", "prompt": "ignored"}, {"other": "x"}]
    (root / "three.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with gzip.open(root / "four.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "b c d"}) + "\n")
    return root


def options(**overrides: object) -> dict:
    defaults = {**TREE_OPTIONS, **AdedDrafter.OPTIONS}
    return {**{name: option.default for name, option in defaults.items()}, **overrides}


def table(successors: dict[tuple[int, int], list[tuple[int, float]]]):
    """A hand-made matrix as the ``Successors`` callable MCTS reads."""

    def lookup(w1: int, w2: int) -> tuple[np.ndarray, np.ndarray]:
        entries = successors.get((w1, w2), [])
        return np.array([t for t, _ in entries], np.int64), np.array([p for _, p in entries], np.float64)

    return lookup


# ---------------------------------------------------------------- MCTS
def test_selection_score_follows_the_formula() -> None:
    values, visits, priors = np.array([3.0, 0.0]), np.array([2.0, 0.0]), np.array([0.5, 0.25])
    explore = (32 + math.log((2 + 8 + 1) / 8)) * math.sqrt(2)
    expected = [3.0 / 2 + explore * 0.5 / 3, 0 + explore * 0.25 / 1]
    np.testing.assert_allclose(selection_scores(values, visits, priors, parent_visits=2), expected)


def test_search_merges_most_visited_paths_with_greedy_extension() -> None:
    # Worked by hand: iteration 1 takes 2 (ties at N_parent=0 go to the higher prior), reward
    # 1 + .6 + 1 (roll-out 4); iteration 2 takes 3 (12.89 > 12.27), reward 1 + .4 + .5;
    # iteration 3 takes 2 (16.31 > 11.04) then 4, reward 2.6. Leaves [2, 4] and [3] have one
    # visit each, [2, 4] is more probable; [3] is extended greedily by 5 (depth 2 is full for [2, 4]).
    lookup = table({(0, 1): [(2, 0.6), (3, 0.4)], (1, 2): [(4, 1.0)], (1, 3): [(5, 0.5), (6, 0.5)]})
    tree = search(lookup, 0, 1, SearchParams(iterations=3, depth=2), np.random.default_rng(0))
    assert tree.tokens.tolist() == [2, 4, 3, 5]
    assert tree.parents.tolist() == [-1, 0, -1, 2]


def test_search_puts_the_most_visited_path_first_and_keeps_the_budget() -> None:
    lookup = table(
        {
            (0, 1): [(2, 0.9), (3, 0.1)],
            (1, 2): [(4, 0.7), (5, 0.3)],
            (1, 3): [(6, 1.0)],
            (2, 4): [(7, 1.0)],
            (2, 5): [(8, 1.0)],
            (3, 6): [(9, 1.0)],
            (4, 7): [(2, 1.0)],
            (5, 8): [(2, 1.0)],
            (6, 9): [(2, 1.0)],
        }
    )
    params = SearchParams(iterations=150, depth=3, max_nodes=5)
    tree = search(lookup, 0, 1, params, np.random.default_rng(0))
    assert tree.tokens[:3].tolist() == [2, 4, 7]  # the most probable full-depth path
    assert tree.parents[:3].tolist() == [-1, 0, 1]
    assert tree.num_nodes == 5 and tree.max_depth <= 3


def test_search_is_empty_without_successors_and_seeded() -> None:
    rng = np.random.default_rng(0)
    assert search(table({}), 0, 1, SearchParams(), rng).num_nodes == 0
    lookup = table({(a, b): [(c, 0.5), ((c + 1) % 6, 0.3)] for a in range(6) for b in range(6) for c in [(a + b) % 6]})
    trees = [search(lookup, 0, 1, SearchParams(depth=5), np.random.default_rng(7)) for _ in range(2)]
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
    assert trees[0].max_depth <= 5 and trees[0].num_nodes <= 64


# ---------------------------------------------------------------- the matrix
def test_build_counts_normalises_and_keeps_top_k(corpus: Path, tokenizer_dir: str) -> None:
    tok = trigram.load_tokenizer(tokenizer_dir)
    matrix = trigram.build([corpus], tok, top_k=12, progress=False)
    a, b, c, d, e, f, g = range(1, 8)
    ids, probs = matrix.base(a, b)  # "a b c" twice (txt, py), "a b d" once; skip.bin is not read
    assert ids.tolist() == [c, d]
    np.testing.assert_allclose(probs, [2 / 3, 1 / 3], rtol=1e-6)
    ids, probs = matrix.base(e, f)  # text: "e f g", prompt: "e f g", content (before prompt): "e f a"
    assert ids.tolist() == [g, a]
    np.testing.assert_allclose(probs, [2 / 3, 1 / 3], rtol=1e-6)
    assert matrix.base(b, c)[0].tolist() == [a, d]  # across the line end of one.txt; gz jsonl
    sources = matrix.meta["sources"]
    assert sources["jsonl_fields"] == {"text": 2, "prompt": 1, "content": 1} and sources["jsonl_skipped"] == 1
    top1 = trigram.build([corpus], tok, top_k=1, progress=False)
    ids, probs = top1.base(a, b)
    assert ids.tolist() == [c] and probs.tolist() == pytest.approx([2 / 3])  # still P(c | a b), not renormalised
    assert top1.meta["stats"]["kept_mass"] < matrix.meta["stats"]["kept_mass"] == 1.0


def test_build_excludes_globs_under_directories(corpus: Path, tokenizer_dir: str) -> None:
    everything = trigram.corpus_files([corpus])
    assert corpus / "code" / "two.py" in everything
    kept = trigram.corpus_files([corpus], exclude=["code/*", "*.gz"])
    assert sorted(p.name for p in kept) == ["one.txt", "three.jsonl"]
    # a file named on the command line is read whatever the globs say
    assert trigram.corpus_files([corpus / "code" / "two.py"], exclude=["*"]) == [corpus / "code" / "two.py"]
    a, b, c, d = range(1, 5)
    matrix = trigram.build([corpus], trigram.load_tokenizer(tokenizer_dir), progress=False, exclude=["code/*"])
    ids, probs = matrix.base(a, b)  # two.py's "a b c" is gone: one.txt's "a b c", "a b d" remain
    assert ids.tolist() == [c, d] and probs.tolist() == pytest.approx([1 / 2, 1 / 2])
    assert matrix.meta["sources"]["files"] == 3


def test_counter_merges_partial_counts_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 5, size=n) for n in rng.integers(0, 40, size=30)]
    monkeypatch.setattr(trigram, "REDUCE_CODES", 7)  # reduce many times on the way
    counter = trigram.TrigramCounter(5)
    for ids in documents:
        counter.add(ids)
    codes, counts = counter.finish()
    expected = np.concatenate([(d[:-2] * 5 + d[1:-1]) * 5 + d[2:] for d in documents if d.size >= 3])
    unique, expected_counts = np.unique(expected, return_counts=True)
    np.testing.assert_array_equal(codes, unique)
    np.testing.assert_array_equal(counts, expected_counts)
    assert counter.tokens == sum(d.size for d in documents)


def test_save_load_round_trip_is_memory_mapped(corpus: Path, tokenizer_dir: str, tmp_path: Path) -> None:
    built = trigram.build([corpus], trigram.load_tokenizer(tokenizer_dir), progress=False)
    built.save(tmp_path / "m")
    loaded = trigram.load(tmp_path / "m", tokenizer_dir)
    assert isinstance(loaded.keys, np.memmap)
    for name in trigram.ARRAYS:
        np.testing.assert_array_equal(getattr(loaded, name), getattr(built, name))
    assert loaded.meta["tokenizer"]["vocab_size"] == len(WORDS) and loaded.top_k == 12


def test_load_refuses_another_tokenizer(corpus: Path, tokenizer_dir: str, tmp_path: Path) -> None:
    trigram.build([corpus], trigram.load_tokenizer(tokenizer_dir), progress=False).save(tmp_path / "m")
    other = make_tokenizer(tmp_path / "other", [*WORDS[:-1], "h"])  # same size, one word differs
    with pytest.raises(trigram.TokenizerMismatchError) as error:
        trigram.load(tmp_path / "m", other)
    message = str(error.value)
    assert tokenizer_dir in message and str(tmp_path / "other") in message
    assert f"trigram build --tokenizer {tmp_path / 'other'} --out {tmp_path / 'm'}" in message


def test_cli_build_and_info(corpus: Path, tokenizer_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cli"
    code = trigram.main(
        [
            "build",
            "--tokenizer",
            tokenizer_dir,
            "--out",
            str(out),
            "--top-k",
            "2",
            "--no-progress",
            str(corpus / "one.txt"),
            str(corpus / "three.jsonl"),
        ]
    )
    assert code == 0
    report = capsys.readouterr().out
    assert "keys" in report and "coverage" in report and "text: 1, prompt: 1, content: 1" in report
    assert trigram.main(["info", str(out)]) == 0
    assert "top 2" in capsys.readouterr().out
    assert trigram.main(["info", str(tmp_path / "missing")]) == 1
    assert "trigram build" in capsys.readouterr().err


# ---------------------------------------------------------------- overlays
def test_lookup_merges_base_and_overlays() -> None:
    base = trigram.TrigramMatrix.from_counts(np.array([(1 * 8 + 2) * 8 + 3, (1 * 8 + 2) * 8 + 4]), np.array([3, 1]), 8)
    overlay = trigram.Overlay()
    assert base.lookup(1, 2, [overlay])[1].tolist() == pytest.approx([0.75, 0.25])  # nothing seen yet
    overlay.observe([5, 5, 6], step=0.04, cap=0.5)
    ids, probs = base.lookup(5, 5, [overlay])  # overlay only: a sub-distribution, not renormalised
    assert ids.tolist() == [6] and probs.tolist() == pytest.approx([0.04])
    overlay.observe([1, 2, 4] * 6, step=0.1, cap=0.5)
    ids, probs = base.lookup(1, 2, [overlay], cap=0.5)  # 0.25 + min(0.6, cap 0.5): sum 1.5 -> renormalised
    assert ids.tolist() == [3, 4] and probs.tolist() == pytest.approx([0.5, 0.5])


def request(req_id: str, tokens: list[int], **overrides: object) -> DraftRequest:
    return DraftRequest(req_id, np.array(tokens), options(**overrides))


def gain(drafter: AdedDrafter, req_id: str, w1: int, w2: int, w3: int) -> float:
    return drafter._requests[req_id].overlay.get(w1, w2).get(w3, 0.0)


def test_adaptive_update_is_incremental_capped_and_per_request() -> None:
    drafter = AdedDrafter(options())
    drafter.propose([request("r1", [1, 2, 3, 1, 2])])
    assert gain(drafter, "r1", 1, 2, 3) == pytest.approx(0.04)
    drafter.propose([request("r1", [1, 2, 3, 1, 2, 3])])  # only the new "1 2 3" counts, not the prompt again
    assert gain(drafter, "r1", 1, 2, 3) == pytest.approx(0.08)
    drafter.propose([request("r1", [1, 2, 3] * 30)])
    assert gain(drafter, "r1", 1, 2, 3) == pytest.approx(trigram.DEFAULT_ADAPT_CAP)
    drafter.propose([request("r2", [5, 6])])
    assert gain(drafter, "r2", 1, 2, 3) == 0.0 and len(drafter.shared) == 0


def test_global_update_is_shared_when_opted_in() -> None:
    drafter = AdedDrafter(options())
    drafter.propose([request("r1", [1, 2, 3, 1, 2], global_update=True)])
    assert gain(drafter, "r1", 1, 2, 3) == 0.0 and drafter.shared.get(1, 2) == {3: pytest.approx(0.04)}
    tree = drafter.propose([request("r2", [4, 1, 2])])[0]  # never saw "1 2 3" itself
    assert tree.tokens[0] == 3


def test_window_seeds_only_recent_context_with_a_corpus(corpus: Path, tokenizer_dir: str, tmp_path: Path) -> None:
    trigram.build([corpus], trigram.load_tokenizer(tokenizer_dir), progress=False).save(tmp_path / "m")
    drafter = AdedDrafter(options(trigram=str(tmp_path / "m"), tokenizer=tokenizer_dir))
    drafter.propose([request("r", [5, 6, 7, 1, 2, 3, 4], adapt_window=4)])
    assert gain(drafter, "r", 5, 6, 7) == 0.0  # outside the last 4 tokens
    assert gain(drafter, "r", 2, 3, 4) == pytest.approx(0.04) and gain(drafter, "r", 1, 2, 3) == pytest.approx(0.04)
    assert gain(drafter, "r", 7, 1, 2) == 0.0


def test_drafter_needs_a_matching_tokenizer_for_a_corpus(corpus: Path, tokenizer_dir: str, tmp_path: Path) -> None:
    trigram.build([corpus], trigram.load_tokenizer(tokenizer_dir), progress=False).save(tmp_path / "m")
    with pytest.raises(SpecbeamConfigError, match="'tokenizer'"):
        AdedDrafter(options(trigram=str(tmp_path / "m")))
    other = make_tokenizer(tmp_path / "other", ["[UNK]", "x"])
    with pytest.raises(SpecbeamConfigError, match="rebuild"):
        AdedDrafter(options(trigram=str(tmp_path / "m"), tokenizer=other))


def test_corpus_drafts_follow_the_matrix(corpus: Path, tokenizer_dir: str, tmp_path: Path) -> None:
    trigram.build([corpus], trigram.load_tokenizer(tokenizer_dir), progress=False).save(tmp_path / "m")
    drafter = AdedDrafter(options(trigram=str(tmp_path / "m"), tokenizer=tokenizer_dir))
    tree = drafter.propose([request("r", [5, 6])])[0]  # "e f" -> g (2/3) or a (1/3)
    assert tree.tokens[tree.children()].tolist() == [7, 1]


def test_no_corpus_drafts_from_the_prompt_and_respects_the_budget() -> None:
    drafter = AdedDrafter(options())
    prompt = [1, 2, 3, 4, 5, 6, 7] * 3 + [1, 2]
    tree, empty, short = drafter.propose([request("r", prompt), request("new", [9, 9, 8]), request("one", [1])])
    assert tree.tokens[tree.path_to(3)].tolist() == [3, 4, 5, 6]  # the repeated continuation, 4 deep
    assert tree.num_nodes <= 16 and tree.max_depth <= 4
    assert empty.num_nodes == 0 and short.num_nodes == 0


def test_remove_requests_frees_state() -> None:
    drafter = AdedDrafter(options())
    drafter.propose([request("r1", [1, 2, 3]), request("r2", [1, 2, 3])])
    drafter.remove_requests(["r1", "unknown"])
    assert set(drafter._requests) == {"r2"}
