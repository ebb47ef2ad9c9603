"""``lookup_tree``'s cross-request index (``"scope": "global"``): insertion, matching, partitions by
``cache_salt``, eviction, drafts.

Matching is checked against a brute-force search on small random sequences;
the engine tests draft one request from another's output inside vLLM (isolation
between salts inside vLLM: test_index_isolation.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import greedy, make_prompts, runner_stats, token_ids
from specs import LOOKUP, LOOKUP_GLOBAL

from vllm_specbeam.core.budget import FILL_KIND
from vllm_specbeam.core.config import TREE_OPTIONS, parse
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.lookup import INDEX_KIND, continuations, match_ends, match_kind, match_levels
from vllm_specbeam.core.tree import ROOT
from vllm_specbeam.methods.lookup_tree.drafter import LookupTreeDrafter
from vllm_specbeam.methods.lookup_tree.index import REPORTED_PARTITIONS, SEPARATOR, IndexStats, SuffixIndex


def test_sequences_sit_end_to_end_with_separators() -> None:
    """The module docstring's example."""
    index = SuffixIndex(100)
    index.add(None, np.asarray([5, 6, 7]))
    index.add(None, np.asarray([8, 6, 9]))
    unsalted = index.partition(None)
    assert unsalted.corpus.tolist() == [5, 6, 7, SEPARATOR, 8, 6, 9, SEPARATOR]
    found = match_ends(unsalted.corpus, np.asarray([1, 6]), 1, 3)
    assert found.ends.tolist() == [5, 1] and found.length == 1
    assert [path.tolist() for path in continuations(unsalted.corpus, found.ends, 4)] == [[9], [7]]


def brute_force(corpus: list[int], query: list[int], low: int, high: int) -> tuple[list[int], int]:
    """Ends of the longest suffix n-gram of ``query`` in ``corpus``, most recent first."""
    for n in range(min(high, len(query)), low - 1, -1):
        gram = query[-n:]
        ends = [i for i in range(n - 1, len(corpus)) if corpus[i - n + 1 : i + 1] == gram]
        if ends:
            return ends[::-1], n
    return [], 0


@pytest.mark.parametrize("seed", range(20))
def test_matching_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    index = SuffixIndex(200)
    for _ in range(rng.integers(1, 6)):
        index.add("s", rng.integers(0, 4, rng.integers(1, 30)))
    partition = index.partition("s")
    query = rng.integers(0, 4, rng.integers(1, 8))
    low, high = int(rng.integers(1, 3)), int(rng.integers(3, 6))
    found = match_ends(partition.corpus, query, low, high)
    ends, length = brute_force(partition.corpus.tolist(), query.tolist(), low, high)
    assert found.ends.tolist() == ends and found.length == length
    for path in continuations(partition.corpus, found.ends, 50):  # never into the next request
        assert SEPARATOR not in path.tolist()


@pytest.mark.parametrize("seed", range(10))
def test_occurrence_lists_equal_a_scan_as_sequences_come_and_go(seed: int) -> None:
    """Through adds and evictions under three salts: every token's occurrences are where a scan
    of the corpus finds it, and matching from them gives the scan's levels."""
    rng = np.random.default_rng(seed)
    index = SuffixIndex(120)
    for _ in range(60):
        index.add(["a", "b", None][rng.integers(0, 3)], rng.integers(0, 6, rng.integers(1, 25)))
        for salt in ("a", "b", None):
            if (partition := index.partition(salt)) is None:
                continue
            corpus = partition.corpus
            for token in range(6):
                assert partition.occurrences(token).tolist() == np.flatnonzero(corpus == token).tolist()
            query = rng.integers(0, 6, rng.integers(1, 8))
            expected = [(m.length, m.ends.tolist()) for m in match_levels(corpus, query, 1, 5)]
            assert [(m.length, m.ends.tolist()) for m in partition.source(query, 1, 5).levels] == expected


def test_memory_stays_bounded_over_a_long_run() -> None:
    """5,000 sequences through a 2,000-token index: what it holds, occurrence lists included, stays
    within 8 bytes a token and separator and 12 an occurrence, a quarter of the oldest run's
    occurrences being evicted ones not yet dropped (a third more than its live ones); and the
    runs stay few (each under half the one before)."""
    rng = np.random.default_rng(0)
    index = SuffixIndex(2000)
    for _ in range(5000):
        index.add(None, rng.integers(0, 100, rng.integers(1, 60)))
        partition = index.partition(None)
        assert partition.nbytes <= 8 * (2000 + partition.num_sequences) + 12 * 2000 * 4 // 3 + 12 * 60
        assert len(partition._runs) <= 12


def test_oldest_sequences_are_evicted_past_the_cap() -> None:
    """One partition (no salts, or one for all): first in, first out, as before salts."""
    index = SuffixIndex(10)
    for first in (10, 20, 30):
        index.add(None, np.arange(first, first + 4))
    unsalted = index.partition(None)
    assert index.num_tokens == 8 and unsalted.num_sequences == 2  # 12 tokens: the first sequence went
    assert match_ends(unsalted.corpus, np.asarray([11]), 1, 1).length == 0
    assert match_ends(unsalted.corpus, np.asarray([21]), 1, 1).length == 1
    index.add(None, np.arange(100, 125))  # longer than the cap: its last 10 tokens
    assert index.num_tokens == 10 and unsalted.corpus.tolist() == [*range(115, 125), SEPARATOR]
    assert index.stats() == IndexStats(1, [10], 3)


def test_each_salt_reads_its_own_partition() -> None:
    """Sequences land in their salt's partition; the unsalted one is a partition like the others."""
    index = SuffixIndex(100)
    index.add("a", np.asarray([1, 2, 3]))
    index.add(None, np.asarray([4, 5]))
    index.add("b", np.asarray([6, 7]))
    index.add("a", np.asarray([8]))
    assert index.partition("a").corpus.tolist() == [1, 2, 3, SEPARATOR, 8, SEPARATOR]
    assert index.partition("b").corpus.tolist() == [6, 7, SEPARATOR]
    assert index.partition(None).corpus.tolist() == [4, 5, SEPARATOR]
    assert index.partition("c") is None
    assert index.nbytes == 8 * (8 + 4) + 12 * 8  # a token and a separator each, and an occurrence a token
    assert index.stats() == IndexStats(3, [4, 2, 2], 0)


def test_the_largest_partition_evicts_first_and_the_newest_sequence_stays() -> None:
    """Cap 12, several salts: "a" floods with 4-token sequences beside "b" (3 tokens) and "c" (2);
    only "a"'s oldest go, down to one sequence. A sequence that makes its own partition the
    largest stays, the next largest ones pay. Ties go to the partition created first."""
    index = SuffixIndex(12)
    index.add("b", np.arange(100, 103))
    index.add("c", np.arange(200, 202))
    for first in range(0, 40, 4):
        index.add("a", np.arange(first, first + 4))
        assert index.num_tokens == sum(index.stats().largest_partition_tokens) <= 12
    assert index.partition("a").corpus.tolist() == [36, 37, 38, 39, SEPARATOR]
    assert index.stats() == IndexStats(3, [4, 3, 2], 9)
    index.add("d", np.arange(300, 310))  # 19 tokens: "a" (4), then "b" (3) go; "d"'s one sequence stays
    assert index.partition("a") is None and index.partition("b") is None
    assert index.partition("d").corpus.tolist() == [*range(300, 310), SEPARATOR]
    assert index.stats() == IndexStats(2, [10, 2], 11)

    tie = SuffixIndex(6)
    for salt, tokens in (("x", [1, 2, 3]), ("y", [4, 5, 6]), ("z", [7])):
        tie.add(salt, np.asarray(tokens))
    assert tie.partition("x") is None and tie.num_tokens == 4


@pytest.mark.parametrize("seed", range(10))
def test_a_mixed_load_of_salts_stays_within_the_cap(seed: int) -> None:
    """Random sequences under five salts and none: the total never passes the cap; whenever an
    add evicts, no partition that kept all its text was larger than one that lost some (sizes
    counted with the new sequence): the largest pay first; and no other partition within an equal
    share of what the new sequence leaves lost any (the module docstring's guarantee)."""
    rng = np.random.default_rng(seed)
    index = SuffixIndex(100)
    salts = [None, "a", "b", "c", "d", "e"]

    def sizes() -> dict[str | None, int]:
        return {salt: p.num_tokens for salt in salts if (p := index.partition(salt)) is not None}

    for _ in range(300):
        salt, length = salts[rng.integers(0, len(salts))], int(rng.integers(1, 40))
        grown = sizes()
        if salt in grown:
            grown[salt] += length
        index.add(salt, rng.integers(0, 50, length))
        now = sizes()
        assert index.num_tokens == sum(now.values()) <= 100
        lost = [s for s in grown if now.get(s, 0) < grown[s]]
        kept = [s for s in grown if s not in lost]
        if lost and kept:
            assert max(grown[s] for s in kept) <= min(grown[s] for s in lost), (grown, now)
        share = (100 - length) / len({*grown, salt})
        assert not [s for s in lost if s != salt and grown[s] <= share], (grown, now, share)
    stats = index.stats()
    assert stats.evicted_sequences > 0 and stats.partitions > 1
    assert len(stats.largest_partition_tokens) == min(stats.partitions, REPORTED_PARTITIONS)


def options(**overrides) -> dict:
    values = {name: option.default for name, option in {**TREE_OPTIONS, **LookupTreeDrafter.OPTIONS}.items()}
    return {**values, "num_speculative_tokens": 4, "max_nodes": 8, **overrides}


def test_the_longer_match_drafts_and_opted_out_requests_are_not_indexed() -> None:
    drafter = LookupTreeDrafter(options(scope="global"))
    assert drafter.learns_across_requests
    drafter.finished([DraftRequest("a", np.asarray([1, 2, 3, 4, 5, 6, 7]), options())])
    drafter.finished([DraftRequest("b", np.asarray([1, 2, 3, 9, 9, 9, 9]), options(share=False))])
    # own history matches "2 3" once (continuing 8); the index matches "1 2 3" (continuing 4 5 6 7)
    request = DraftRequest("c", np.asarray([2, 3, 8, 0, 1, 2, 3]), options())
    tree = drafter.propose([request])[0]
    assert tree.tokens.tolist() == [4, 5, 6, 7]
    local = LookupTreeDrafter(options()).propose([request])[0]
    assert local.tokens.tolist() == [8, 0, 1, 2] and not LookupTreeDrafter(options()).learns_across_requests
    drafter.forget_finished()  # a newly started engine's index: the request's own history again
    assert drafter.propose([request])[0].tokens.tolist() == [8, 0, 1, 2]
    assert drafter.state_bytes == SuffixIndex(1).nbytes


def test_a_salt_drafts_only_from_finished_requests_with_the_same_salt() -> None:
    """Request A (salt "a") and an unsalted one finish; B's identical text drafts from A's only under
    salt "a" (its nodes marked ``from_index``), never under "b" or no salt; the unsalted requests
    share theirs. ``"index_isolation": "none"``: one index for all, as before salts."""
    text = np.asarray([1, 2, 3, 4, 5, 6, 7])
    query = np.asarray([9, 1, 2, 3])
    salted = LookupTreeDrafter(options(scope="global"))
    assert salted.salted_index(salted.options)
    salted.finished([DraftRequest("a", text, options(), cache_salt="a")])
    salted.finished([DraftRequest("u", text + 10, options())])

    def draft(drafter: LookupTreeDrafter, tokens: np.ndarray, salt: str | None):
        return drafter.propose([DraftRequest("b", tokens, options(), cache_salt=salt)])[0]

    same = draft(salted, query, "a")
    assert same.tokens.tolist() == [4, 5, 6, 7] and same.from_index.tolist() == [True] * 4
    for salt in ("b", None):
        assert draft(salted, query, salt).num_nodes == 0
    assert draft(salted, query + 10, None).tokens.tolist() == [14, 15, 16, 17]  # the unsalted partition
    assert draft(salted, query + 10, "a").num_nodes == 0
    own = draft(salted, np.asarray([1, 2, 8, 0, 1, 2]), "b")  # the request's own text: not from the index
    assert own.tokens.tolist() == [8, 0, 1, 2] and own.from_index is None
    assert salted.index_stats == {
        "index_partitions": 2,
        "index_largest_partition_tokens": [7, 7],
        "index_evicted_sequences": 0,
    }

    shared = LookupTreeDrafter(options(scope="global", index_isolation="none"))
    assert not shared.salted_index(shared.options)
    shared.finished([DraftRequest("a", text, options(), cache_salt="a")])
    assert draft(shared, query, "b").tokens.tolist() == [4, 5, 6, 7]
    assert draft(shared, query, None).from_index.tolist() == [True] * 4


def test_nodes_from_the_index_are_marked_through_a_merged_tree() -> None:
    """Own and index continuations merge into one trie; ``from_index`` marks the nodes an index
    path walks through, and survives ``keep`` and ``truncate``. Request ``[7, 1, 2, 5, 0, 1, 2]``
    continues "1 2" with ``5 0`` itself and with ``3 4`` in the index (a tie: both draft)."""
    drafter = LookupTreeDrafter(options(scope="global", prompt_lookup_max=2))
    drafter.finished([DraftRequest("a", np.asarray([1, 2, 3, 4]), options(), cache_salt="s")])
    tree = drafter.propose([DraftRequest("b", np.asarray([7, 1, 2, 5, 0, 1, 2]), options(), cache_salt="s")])[0]
    marked = {int(t): bool(f) for t, f in zip(tree.tokens, tree.from_index)}
    assert marked == {5: False, 0: False, 1: False, 2: False, 3: True, 4: True}
    assert tree.truncate(1).from_index.size == 1
    assert tree.keep(tree.from_index).from_index.tolist() == [True, True]


def test_nodes_only_the_index_continues_are_a_kind_of_their_own() -> None:
    """The step budget learns how often other requests' text is accepted apart from the
    request's own (``match_kind(n, indexed=True)``): "1 2" goes on with ``5 0 1 2`` in the
    request and with ``5 9`` in the index; ``5`` is the request's own kind, ``9`` the index's."""
    drafter = LookupTreeDrafter(options(scope="global", prompt_lookup_max=2))
    drafter.finished([DraftRequest("a", np.asarray([1, 2, 5, 9]), options())])
    tree = drafter.propose([DraftRequest("b", np.asarray([7, 1, 2, 5, 0, 1, 2]), options())])[0]
    kinds = {int(t): int(k) for t, k in zip(tree.tokens, tree.kinds)}
    assert kinds == {5: match_kind(2), 0: match_kind(2), 1: match_kind(2), 2: match_kind(2), 9: match_kind(2, True)}
    assert match_kind(2, True) == match_kind(2) + INDEX_KIND < FILL_KIND


def test_nodes_are_labelled_with_the_length_of_their_match() -> None:
    """The step budget calibrates 4+, 3, 2 and 1-token matches' nodes apart (``match_kind``)."""
    drafter = LookupTreeDrafter(options())
    for prompt, kind in (
        ([1, 2, 3, 4, 9, 1, 2, 3, 4], 0),
        ([7, 2, 3, 4, 9, 1, 2, 3, 4], 1),
        ([7, 8, 3, 4, 9, 1, 2, 3, 4], 2),
        ([7, 8, 5, 4, 9, 1, 2, 3, 4], 3),
    ):
        tree = drafter.propose([DraftRequest("r", np.asarray(prompt), options())])[0]
        assert tree.tokens.tolist()[:1] == [9] and set(tree.kinds.tolist()) == {kind}
    assert [match_kind(n) for n in (1, 2, 3, 4, 5, 24)] == [3, 2, 1, 0, 0, 0]


def test_the_more_frequent_continuation_ranks_first() -> None:
    """ "7 8" went on to 1 twice, then to 2 (the most recent): 1 is the first child, 2 its
    sibling, whatever the recency; with one node, only 1 is drafted."""
    tokens = np.asarray([7, 8, 1, 7, 8, 1, 7, 8, 2, 7, 8])
    drafter = LookupTreeDrafter(options())
    tree = drafter.propose([DraftRequest("r", tokens, options())])[0]
    first_level = [token for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()) if parent == ROOT]
    assert first_level == [1, 2]
    one = drafter.propose([DraftRequest("r", tokens, options(max_nodes=1))])[0]
    assert one.tokens.tolist() == [1]


def test_the_global_scope_drafts_as_deep_as_the_match_is_long() -> None:
    """depth_factor 1: a 2-token match drafts 2 deep, a 6-token match 6 deep (of 8)."""
    adaptive = options(scope="global", num_speculative_tokens=8, prompt_lookup_max=24, depth_factor=1.0)
    drafter = LookupTreeDrafter(adaptive)
    drafter.finished([DraftRequest("a", np.arange(30), adaptive)])
    short = DraftRequest("b", np.asarray([50, 51, 52, 3, 4]), adaptive)
    long = DraftRequest("c", np.asarray([50, 1, 2, 3, 4, 5, 6]), adaptive)
    assert [t.tokens.tolist() for t in drafter.propose([short, long])] == [[5, 6], [7, 8, 9, 10, 11, 12]]
    full = DraftRequest("d", np.asarray([50, 51, 52, 3, 4]), {**adaptive, "depth_factor": 0.0})
    assert drafter.propose([full])[0].tokens.tolist() == list(range(5, 13))  # factor 0: always the full depth


def test_a_finished_request_is_indexed_whole_and_its_repeat_drafts_as_deep_as_asked() -> None:
    """The engine's global scope (``LOOKUP_GLOBAL``) indexes a finished request's prompt and output:
    one int64 a token and one for the separator, and 12 bytes a token's occurrence (the runner
    reports ``state_bytes``). The same
    prompt again drafts that output from the index, one chain exactly as deep as asked: the
    runner asks no deeper than the tokens the request has left (the engine test below)."""
    options = parse(LOOKUP_GLOBAL).options
    prompt, output = np.split(np.random.default_rng(0).permutation(1000)[:50], [30])  # no token twice
    drafter = LookupTreeDrafter(options)
    assert drafter.state_bytes == 0
    drafter.finished([DraftRequest("a", np.concatenate([prompt, output]), options)])
    assert drafter.state_bytes == 8 * (prompt.size + output.size + 1) + 12 * (prompt.size + output.size)
    for depth in range(1, options["num_speculative_tokens"] + 1):
        tree = drafter.propose([DraftRequest("b", prompt, {**options, "num_speculative_tokens": depth})])[0]
        assert tree.tokens.tolist() == output[:depth].tolist() and tree.is_chain and tree.from_index.all()
    drafter.forget_finished()
    assert drafter.state_bytes == 0 and drafter.propose([DraftRequest("b", prompt, options)])[0].num_nodes == 0


def test_the_global_scope_changes_defaults_the_user_did_not_set() -> None:
    request_scope = parse({"method": "lookup_tree"}).options
    assert (request_scope["num_speculative_tokens"], request_scope["depth_factor"]) == (4, 0.0)
    chosen = parse({"method": "lookup_tree", "scope": "global"}).options
    assert {k: chosen[k] for k in LookupTreeDrafter.GLOBAL_DEFAULTS} == LookupTreeDrafter.GLOBAL_DEFAULTS
    kept = parse({"method": "lookup_tree", "scope": "global", "max_nodes": 16, "depth_factor": 0.5}).options
    assert (kept["num_speculative_tokens"], kept["max_nodes"], kept["depth_factor"]) == (16, 16, 0.5)


# ---------------------------------------------------------------- inside vLLM
def empty_global_engine(engines, spec: dict):
    """The pool's engine of ``spec`` with an empty index (the worker RPC the benchmarks use)."""
    llm = engines.get(spec)
    llm.collective_rpc("specbeam_forget_finished")
    return llm


def accepted_and_trees(llm, prompt: str, params) -> tuple[list[int], int, int]:
    """``prompt``'s output, and the nodes accepted and trees verified while it ran."""
    before = runner_stats(llm)
    out = token_ids(llm.generate([prompt], params))[0]
    after = runner_stats(llm)
    return out, after["accepted"] - before["accepted"], after["trees"] - before["trees"]


def test_a_request_drafts_from_text_only_another_produced(engines) -> None:
    """Request B continues text that only request A's output holds: with the global scope
    B's drafts come from A's output (nearly every node accepted), without it B finds
    little; outputs are greedy decoding either way. A's ``share: false`` keeps it out."""
    from vllm import TokensPrompt

    prompt = make_prompts(10)[2]
    plain = engines.get(None)
    first = token_ids(plain.generate([prompt], greedy(64)))[0]
    prompt_ids = plain.get_tokenizer().encode(prompt)
    second = TokensPrompt(prompt_token_ids=[*prompt_ids, *first[:16]])
    reference = token_ids(plain.generate([second], greedy(40)))[0]
    assert reference == first[16:56]  # the same context: B continues A's text

    rates = {}
    for scope, share in [("global", True), ("global", False), ("request", True)]:
        llm = empty_global_engine(engines, {**LOOKUP, "scope": "global"}) if scope == "global" else engines.get(LOOKUP)
        params = greedy(64)
        params.extra_args = {"share": share}
        assert token_ids(llm.generate([prompt], params))[0] == first
        out, accepted, trees = accepted_and_trees(llm, second, greedy(40))
        assert out == reference
        rates[(scope, share)] = accepted / max(1, trees)
    assert rates[("global", True)] >= 3.0  # of 4: B's drafts are A's output
    assert rates[("global", True)] > rates[("global", False)] + 1.0
    assert rates[("global", True)] > rates[("request", True)] + 1.0


def test_the_runner_drafts_no_further_than_max_tokens_and_the_context_limit(engines) -> None:
    """Only what the runner adds to the drafter (unit-tested above): the global index drafts a
    repeated request deep, and the runner cuts the drafts to what the request can still take.
    Before ``max_tokens``, every step commits its accepted drafts plus one target token, and together
    they fit in the tokens left; 24 tokens short of ``max_model_len``, vLLM cuts what would pass the
    limit, and the request ends there with the tokens of vLLM without speculation."""
    from conftest import MAX_MODEL_LEN
    from tiny_model import prompt_text

    llm = empty_global_engine(engines, LOOKUP_GLOBAL)
    prompt = make_prompts(10)[3]
    first = token_ids(llm.generate([prompt], greedy(32)))[0]
    again, accepted, trees = accepted_and_trees(llm, prompt, greedy(12))
    assert again == first[:12]
    assert accepted >= 8  # the first run's output drafted the repeat
    assert accepted + trees <= 12 - 1  # the prefill's token, then every step's

    left = 24
    words = [int(w[1:]) for w in " ".join(make_prompts(10)[6:]).split()]
    prompt = prompt_text((words * 8)[: MAX_MODEL_LEN - left])
    reference = token_ids(engines.get(None).generate([prompt], greedy(200)))[0]
    assert len(reference) == left
    llm.generate([prompt], greedy(left // 2))  # indexes the first half of the answer
    out, accepted, _ = accepted_and_trees(llm, prompt, greedy(200))
    assert out == reference and accepted >= left // 4
