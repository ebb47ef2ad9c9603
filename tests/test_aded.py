"""ADED: tri-gram matrix, adaptive overlays, MCTS draft trees and the drafter."""

from __future__ import annotations

import gzip
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from vllm_specbeam.core.config import TREE_OPTIONS, SpecbeamConfigError
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import ROOT, DraftTree
from vllm_specbeam.methods.aded import drafter as drafter_module
from vllm_specbeam.methods.aded import mcts, trigram
from vllm_specbeam.methods.aded.drafter import CONTEXT, CORPUS, SEARCH_KIND, AdedDrafter, Draft, SearchRest
from vllm_specbeam.methods.aded.mcts import SearchParams, SuccessorTable, search, selection_scores
from vllm_specbeam.methods.lookup_tree.drafter import LookupTreeDrafter

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


Entries = dict[tuple[int, int], list[tuple[int, float]]]


def table(successors: Entries) -> mcts.Successors:
    """A hand-made matrix as the batched ``Successors`` callable MCTS reads."""

    def lookup(pairs: np.ndarray) -> SuccessorTable:
        rows = [successors.get((w1, w2), []) for w1, w2 in pairs.tolist()]
        return SuccessorTable.from_rows([([t for t, _ in r], [p for _, p in r]) for r in rows])

    return lookup


def random_entries(rng: np.random.Generator, vocab: int, most: int) -> Entries:
    """Every state of a small vocabulary with 0..``most`` successors, most probable first."""
    entries: Entries = {}
    for w1 in range(vocab):
        for w2 in range(vocab):
            k = int(rng.integers(0, most + 1))
            probs = np.sort(rng.dirichlet(np.ones(k)) * rng.uniform(0.3, 1.0))[::-1] if k else []
            entries[(w1, w2)] = list(zip(rng.choice(vocab, k, replace=False).tolist(), list(probs), strict=True))
    return entries


def reference_search(entries: Entries, w1: int, w2: int, params: SearchParams, rng: np.random.Generator) -> DraftTree:
    """The search one walk at a time, one node object per search node (the former implementation)."""
    nodes: dict[tuple[int, ...], list[float]] = {(): [0.0, 0.0]}  # path -> [visits, summed reward]

    def following(path: tuple[int, ...]) -> list[tuple[int, float]]:
        state = ((w1, w2) + path)[-2:]
        return entries.get((state[0], state[1]), [])

    def score(path: tuple[int, ...]) -> np.ndarray:
        kids = [path + (t,) for t, _ in following(path)]
        values = np.array([nodes.get(k, [0.0, 0.0])[1] for k in kids])
        visits = np.array([nodes.get(k, [0.0, 0.0])[0] for k in kids])
        priors = np.array([p for _, p in following(path)])
        return selection_scores(values, visits, priors, nodes[path][0], params.c1, params.c2)

    if not following(()) or params.depth < 1:
        return DraftTree.empty()
    uniforms = rng.random((params.iterations, params.depth))
    for u in uniforms:
        path: tuple[int, ...] = ()
        reward = 1.0
        while following(path) and len(path) < params.depth:
            i = int(np.argmax(score(path)))
            reward += following(path)[i][1]
            path = path + (following(path)[i][0],)
            if path not in nodes:
                nodes[path] = [0.0, 0.0]
                break
        tail = path
        for x in u[: params.depth - len(path)]:
            options = following(tail)
            if not options:
                break
            cumulative = np.cumsum([p for _, p in options])
            i = min(int(np.searchsorted(cumulative, x * cumulative[-1], side="right")), len(options) - 1)
            reward += options[i][1]
            tail = tail + (options[i][0],)
        for k in range(len(path) + 1):
            nodes[path[:k]][0] += 1
            nodes[path[:k]][1] += reward
    order = {
        p: i
        for i, p in enumerate(
            sorted(nodes, key=lambda p: [[t for t, _ in following(p[:d])].index(p[d]) for d in range(len(p))])
        )
    }
    leaves = [p for p in nodes if p and not any(q[: len(p)] == p and len(q) > len(p) for q in nodes)]
    prob = {p: math.prod(dict(following(p[:d]))[p[d]] for d in range(len(p))) for p in leaves}
    leaves.sort(key=lambda p: (-nodes[p][0], -prob[p], order[p]))
    paths = [list(p) + ([following(p)[0][0]] if len(p) < params.depth and following(p) else []) for p in leaves]
    return DraftTree.from_paths(paths[: params.num_paths], params.max_nodes)


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
    tree = search(lookup, 0, 1, SearchParams(iterations=3, depth=2, wave=1), np.random.default_rng(0)).tree
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
    tree = search(lookup, 0, 1, params, np.random.default_rng(0)).tree
    assert tree.tokens[:3].tolist() == [2, 4, 7]  # the most probable full-depth path
    assert tree.parents[:3].tolist() == [-1, 0, 1]
    assert tree.num_nodes == 5 and tree.max_depth <= 3


def test_search_is_empty_without_successors_and_seeded() -> None:
    rng = np.random.default_rng(0)
    assert search(table({}), 0, 1, SearchParams(), rng).tree.num_nodes == 0
    lookup = table({(a, b): [(c, 0.5), ((c + 1) % 6, 0.3)] for a in range(6) for b in range(6) for c in [(a + b) % 6]})
    trees = [search(lookup, 0, 1, SearchParams(depth=5), np.random.default_rng(7)).tree for _ in range(2)]
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
    assert trees[0].max_depth <= 5 and trees[0].num_nodes <= 64


@pytest.mark.parametrize("vocab, most", [(3, 1), (6, 4), (12, 12)])
def test_waves_of_one_walk_are_the_sequential_search(vocab: int, most: int) -> None:
    rng = np.random.default_rng(vocab)
    for seed in range(40):
        entries = random_entries(rng, vocab, most)
        params = SearchParams(
            iterations=int(rng.integers(1, 60)),
            depth=int(rng.integers(1, 6)),
            max_nodes=int(rng.integers(1, 20)),
            num_paths=int(rng.integers(1, 10)),
            wave=1,
        )
        expected = reference_search(entries, 0, 1, params, np.random.default_rng(seed))
        tree = search(table(entries), 0, 1, params, np.random.default_rng(seed)).tree
        assert (tree.tokens.tolist(), tree.parents.tolist()) == (expected.tokens.tolist(), expected.parents.tolist())


def test_a_wave_sends_its_walks_where_one_by_one_argmaxes_would() -> None:
    """Brute force: m walks, each taking the argmax after the earlier ones' virtual visits."""
    rng = np.random.default_rng(3)
    entries = {(0, 1): [(t, p) for t, p in zip(range(2, 8), np.sort(rng.dirichlet(np.ones(6)))[::-1], strict=True)]}
    states = mcts._States(table(entries), 4)
    tree = mcts._Tree(64, int(states.rows_of(np.array([[0, 1]]))[0]))
    tree.children = mcts._widen(tree.children, 0, 6, mcts.NONE)
    params = SearchParams(depth=1)
    for walks in (5, 9, 13):  # three waves on the same root, with rewards in between
        visits = np.array([tree.visits[c] for c in tree.children[0, :6]])  # [6]; NONE reads the spare node
        values = np.array([tree.values[c] for c in tree.children[0, :6]])
        sent = np.zeros(6)
        for _ in range(walks):
            scores = selection_scores(values, visits + sent, states.probs[0, :6], tree.visits[0] + walks - 1)
            sent[int(np.argmax(scores))] += 1
        leaves = mcts._select(tree, states, params, walks)
        np.testing.assert_array_equal(np.bincount(tree.slot[leaves], minlength=6), sent)
        mcts._backup(tree, leaves, rng.uniform(1, 3, leaves.size))


@pytest.mark.parametrize("wave", [0, 3, 1000])
def test_search_keeps_budget_depth_and_successors_for_any_wave(wave: int) -> None:
    rng = np.random.default_rng(wave)
    for seed in range(30):
        entries = random_entries(rng, 8, 5)
        params = SearchParams(
            iterations=int(rng.integers(1, 200)),
            depth=int(rng.integers(1, 6)),
            max_nodes=int(rng.integers(1, 30)),
            wave=wave,
        )
        result = search(table(entries), 0, 1, params, np.random.default_rng(seed))
        again = search(table(entries), 0, 1, params, np.random.default_rng(seed))
        tree = result.tree
        assert tree.tokens.tolist() == again.tree.tokens.tolist()  # reproducible per seed
        assert tree.num_nodes <= params.max_nodes and (tree.num_nodes == 0 or tree.max_depth <= params.depth)
        assert result.iterations == (params.iterations if entries[(0, 1)] else 0)
        for i, parent in enumerate(tree.parents.tolist()):  # every node is a successor of its parent's state
            path = [0, 1, *tree.tokens[tree.path_to(parent)].tolist()] if parent != ROOT else [0, 1]
            assert int(tree.tokens[i]) in [t for t, _ in entries[(path[-2], path[-1])]]


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
def successors_of(found: trigram.Continuations, row: int) -> tuple[list[int], list[float], list[bool]]:
    n = int(found.table.counts[row])
    table = found.table
    return table.tokens[row, :n].tolist(), table.probs[row, :n].tolist(), found.from_corpus[row, :n].tolist()


def test_lookup_merges_base_and_overlays() -> None:
    base = trigram.TrigramMatrix.from_counts(np.array([(1 * 8 + 2) * 8 + 3, (1 * 8 + 2) * 8 + 4]), np.array([3, 1]), 8)
    overlay = trigram.Overlay()
    found = base.lookup(np.array([[1, 2], [5, 5], [9, 1]]), [overlay])  # nothing seen yet; 9 is outside the vocabulary
    assert successors_of(found, 0)[1] == pytest.approx([0.75, 0.25]) and found.table.counts[1:].tolist() == [0, 0]
    overlay.observe([5, 5, 6], step=0.04, cap=0.5)
    ids, probs, corpus = successors_of(base.lookup(np.array([[5, 5]]), [overlay]), 0)  # overlay only: not renormalised
    assert ids == [6] and probs == pytest.approx([0.04]) and corpus == [False]
    overlay.observe([1, 2, 4] * 6, step=0.1, cap=0.5)
    ids, probs, corpus = successors_of(base.lookup(np.array([[1, 2]]), [overlay], cap=0.5), 0)
    assert ids == [3, 4] and probs == pytest.approx([0.5, 0.5])  # 0.25 + min(0.6, cap 0.5): sum 1.5 -> renormalised
    assert corpus == [True, False]  # 4's larger share is its gain


def test_lookup_scales_the_corpus_by_its_weight() -> None:
    # base c (=3) 0.6, d (=4) 0.4 after "1 2"; the request saw "1 2 4" twice (0.08)
    base = trigram.TrigramMatrix.from_counts(np.array([(1 * 8 + 2) * 8 + 3, (1 * 8 + 2) * 8 + 4]), np.array([3, 2]), 8)
    overlay = trigram.Overlay()
    overlay.observe([1, 2, 4, 1, 2, 4], step=0.04, cap=0.5)
    ids, probs, corpus = successors_of(base.lookup(np.array([[1, 2]]), [overlay], corpus_weight=0.1), 0)
    assert ids == [4, 3] and probs == pytest.approx([0.04 + 0.08, 0.06]) and corpus == [False, True]
    ids, probs, corpus = successors_of(base.lookup(np.array([[1, 2]]), [overlay], corpus_weight=2.0), 0)
    assert ids == [3, 4] and probs == pytest.approx([1.2 / 2.08, 0.88 / 2.08]) and corpus == [True, True]


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


# ---------------------------------------------------------------- cost follows the budget
@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The walks (root visits) of every request-step the drafter drafts, in order (0: no search)."""
    seen: list[int] = []
    propose_one = AdedDrafter._propose_one

    def counting_steps(self: AdedDrafter, request: DraftRequest) -> DraftTree:
        seen.append(0)
        return propose_one(self, request)

    def counting_walks(*args: object, **kwargs: object) -> mcts.SearchResult:
        result = search(*args, **kwargs)  # type: ignore[arg-type]
        seen[-1] = result.iterations
        return result

    monkeypatch.setattr(AdedDrafter, "_propose_one", counting_steps)
    monkeypatch.setattr(drafter_module, "search", counting_walks)
    return seen


def test_iterations_follow_the_node_budget(walks: list[int]) -> None:
    drafter = AdedDrafter(options(max_nodes=16, iterations=150))
    prompt = [1, 2, 3, 4, 5, 6, 7] * 3 + [1, 2]
    for budget in (16, 4, 1):  # the search alone
        tree = drafter.propose([request("r", prompt, max_nodes=budget, prompt_lookup_max=0)])[0]
        assert 1 <= tree.num_nodes <= budget
    assert walks == [150, 38, 10]  # the root's visits: 150 x 4/16, 150 x 1/16, rounded up
    drafter.propose([request("r", prompt, max_nodes=1, iterations=3, prompt_lookup_max=0)])
    assert walks[-1] == 1  # never none
    # The earlier "7 1 2"s went on "3 4 5 6": 4 of the nodes; the search gets the other 12.
    walks.clear()
    for budget in (16, 4):
        tree = drafter.propose([request("r", prompt, max_nodes=budget)])[0]
        assert tree.tokens[:4].tolist() == [3, 4, 5, 6]
    assert walks == [113, 0]  # 150 x 12/16 rounded up; none when the matches fill the budget
    auto = AdedDrafter({**options(), "max_nodes": "auto", "auto_max_nodes": 16})  # the per-step budget's cap is full
    assert [auto.iterations(150, budget) for budget in (16, 4, 1)] == [150, 38, 10]


def test_a_fruitless_search_rests_longer_each_time(walks: list[int]) -> None:
    # One successor per tri-gram state: the walks only find the match's own path again,
    # so the target never commits a node of theirs.
    drafter = AdedDrafter(options(max_nodes=16, iterations=150))
    cycle = [1, 2, 3, 4, 5, 6, 7]
    tokens = cycle * 3 + [1, 2]
    for _ in range(16):
        tree = drafter.propose([request("r", tokens)])[0]
        following = [cycle[(tokens[-1] + k) % 7] for k in range(4)]
        assert tree.tokens.tolist() == following and SEARCH_KIND not in tree.kinds.tolist()  # resting or not
        tokens = tokens + following[:1]
    on = 113  # 150 x 12/16, rounded up: the matches took 4 of the 16 nodes
    assert walks == [on, 0, on, 0, 0, on, 0, 0, 0, 0, on, 0, 0, 0, 0, 0]  # rests of 1, 2, 4, then 8


@pytest.mark.parametrize("target_commits_the_search_node", [True, False])
def test_a_search_rests_unless_the_target_commits_a_node_of_its_own(
    walks: list[int], target_commits_the_search_node: bool
) -> None:
    # "1 2" went on "3 4" once, but "2 3" also went on "5": the walks add "3 5", which no match drafts.
    drafter = AdedDrafter(options(max_nodes=16, iterations=150))
    prompt = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2]
    tree = drafter.propose([request("r", prompt)])[0]
    own = [node for node in range(tree.num_nodes) if tree.kinds[node] == SEARCH_KIND]
    assert tree.tokens[tree.path_to(own[0])].tolist() == [3, 5]
    committed = [3, 5] if target_commits_the_search_node else [3, 4]  # its node, or only the match's
    drafter.propose([request("r", prompt + committed)])
    assert walks[0] == 113 and walks[1] == (113 if target_commits_the_search_node else 0)


def test_search_rest_doubles_and_a_fruitful_search_ends_it() -> None:
    rest = SearchRest()
    allowed = []
    for step in range(12):  # the docstring's example: fruitless at 0, 2, 5; committed from 10 on
        allowed.append(rest.allows())
        if allowed[-1]:
            rest.after(paid=step >= 10)
    assert [s for s, ok in enumerate(allowed) if ok] == [0, 2, 5, 10, 11]


def test_search_paid_reads_the_committed_path_through_the_search_nodes() -> None:
    # a (match) -> b (search); c (search) a second root child
    tree = DraftTree(np.array([5, 6, 7]), np.array([ROOT, 0, ROOT]), kinds=np.array([2, SEARCH_KIND, SEARCH_KIND]))
    draft = Draft(tree, None, context=5, searched=True)
    assert draft.search_paid([5, 6]) and draft.search_paid([7, 1])
    assert not draft.search_paid([5, 8]) and not draft.search_paid([6, 7]) and not draft.search_paid([])


# ---------------------------------------------------------------- weighing the corpus
def test_draft_judged_counts_checked_and_kept_nodes_per_source() -> None:
    # a (corpus) -> b (context), c (corpus); d (context) a second root child
    tree = DraftTree(np.array([10, 11, 12, 13]), np.array([ROOT, 0, 0, ROOT]))
    draft = Draft(tree, np.array([CORPUS, CONTEXT, CORPUS, CONTEXT]), context=5, searched=False)
    checked, kept = draft.judged([10, 12, 99])  # a kept, c kept, nothing below c
    assert checked.tolist() == [2, 2] and kept.tolist() == [2, 0]  # a, d; then b, c
    checked, kept = draft.judged([77])  # both root children checked, none kept
    assert checked.tolist() == [1, 1] and kept.tolist() == [0, 0]


def corpus_of(trigrams: dict[tuple[int, int], int], vocab: int = 64) -> trigram.TrigramMatrix:
    """A matrix whose only successor of ``(w1, w2)`` is ``trigrams[(w1, w2)]``, with probability 1."""
    codes = sorted((w1 * vocab + w2) * vocab + w3 for (w1, w2), w3 in trigrams.items())
    return trigram.TrigramMatrix.from_counts(np.array(codes), np.ones(len(codes), np.int64), vocab)


def generate(drafter: AdedDrafter, truth: list[int], start: int, steps: int) -> list[tuple[DraftTree, float]]:
    """Greedy steps against ``truth``: each commits the drafted path matching it, then one more token.
    Per step: the draft (of the tri-gram search alone) and the corpus weight it was drafted with."""
    length, out = start, []
    for _ in range(steps):
        tree = drafter.propose([request("r", truth[:length], prompt_lookup_max=0)])[0]
        out.append((tree, drafter._requests["r"].record.corpus_weight))
        node, kept = ROOT, 0
        while True:
            hit = np.flatnonzero((tree.parents == node) & (tree.tokens == truth[length + kept]))
            if not hit.size:
                break
            node, kept = int(hit[0]), kept + 1
        length += kept + 1
    return out


def test_a_wrong_corpus_sinks_and_the_requests_own_trigrams_win() -> None:
    cycle = [1, 2, 3, 4, 5, 6]
    truth = cycle * 60
    wrong = {(a, b): 20 + b for a, b in itertools.pairwise(truth)}  # after "1 2" the corpus says 22, never 3
    drafter = AdedDrafter(options())
    drafter.matrix = corpus_of(wrong)
    steps = generate(drafter, truth, 18, 12)
    first, _ = steps[0]
    assert first.tokens[0] >= 20  # at first the confident corpus outranks the request's own tri-grams
    weights = [w for _, w in steps]
    assert weights[0] == 1.0 and max(weights[1:]) < 0.05  # (it creeps back up as its old rejections decay)
    for tree, _ in steps[3:]:  # after a few steps the best path is the request's own
        assert tree.tokens[0] < 20


def test_a_right_corpus_gains_weight() -> None:
    truth = list(range(1, 60))  # no tri-gram repeats: the request's own overlay has nothing to offer
    drafter = AdedDrafter(options())
    drafter.matrix = corpus_of({(a, b): c for a, b, c in zip(truth, truth[1:], truth[2:])})
    steps = generate(drafter, truth, 3, 8)
    weights = [w for _, w in steps]
    assert weights[0] == 1.0 and all(b > a for a, b in itertools.pairwise(weights)) and weights[-1] > 1.5
    assert steps[0][0].tokens.tolist() == truth[3:7]  # the corpus's one successor per state: a chain, 4 deep


# ---------------------------------------------------------------- what lookup_tree drafts, first
@pytest.mark.parametrize("budget", [1, 3, 16])
def test_the_tree_starts_with_what_lookup_tree_drafts(budget: int) -> None:
    """aded's first nodes are lookup_tree's own (request-scope) tree, node for node;
    the search fills what the budget has left."""
    prompt = np.random.default_rng(budget).integers(0, 4, size=60)  # 4 tokens: repeats everywhere
    lookup = LookupTreeDrafter({**options(), **{k: o.default for k, o in LookupTreeDrafter.OPTIONS.items()}})
    expected = lookup.propose([DraftRequest("r", prompt, {**lookup.options, "max_nodes": budget})])[0]
    tree = AdedDrafter(options()).propose([request("r", prompt.tolist(), max_nodes=budget)])[0]
    first = tree.truncate(expected.num_nodes)
    assert expected.num_nodes >= 1
    assert first.tokens.tolist() == expected.tokens.tolist() and first.parents.tolist() == expected.parents.tolist()
    assert tree.num_nodes == budget  # the search filled the rest (the 4 tokens have successors)
    # the step budget tells them apart: the matches' kind (as lookup_tree's), then the search's
    assert first.kinds.tolist() == expected.kinds.tolist()
    assert tree.kinds[expected.num_nodes :].tolist() == [SEARCH_KIND] * (budget - expected.num_nodes)


def test_prompt_lookup_options_are_checked() -> None:
    with pytest.raises(SpecbeamConfigError, match="prompt_lookup_min=4 must not exceed prompt_lookup_max=3"):
        AdedDrafter.check_options(options(prompt_lookup_min=4, prompt_lookup_max=3))
    AdedDrafter.check_options(options(prompt_lookup_min=4, prompt_lookup_max=0))  # off: min unused
