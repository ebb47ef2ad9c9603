"""``mcsd``: k_config trees, dynamic depth, the stop-model data, and exactness inside vLLM.

The drafter's unit tests run it on a fake runtime whose logits are a fixed
function of the drafted path, so the expected trees can be computed by hand.
The engine tests run the in-worker draft on tiny models (see ``tiny_model.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, checked_options, greedy, make_prompts, runner_stats, token_ids
from specs import MCSD
from test_sampling_engine import ALPHA, prefix_homogeneity, sample_sequences, target_samples

from vllm_specbeam.adapter.mcsd_train import install_collector
from vllm_specbeam.core.config import SpecbeamConfigError
from vllm_specbeam.core.drafter import DraftRequest
from vllm_specbeam.core.tree import DraftTree
from vllm_specbeam.methods.mcsd import stopping
from vllm_specbeam.methods.mcsd.drafter import McsdDrafter
from vllm_specbeam.methods.mcsd.maths import largest_tree, level_sizes, level_widths

VOCAB = 16


# ---------------------------------------------------------------- shapes
def test_level_widths_pad_with_chains() -> None:
    assert level_widths([4, 2], 4) == [4, 2, 1, 1]
    assert level_widths([4, 2, 2], 2) == [4, 2]
    assert level_sizes([4, 2], 3) == [4, 8, 8]
    assert largest_tree([2, 2], 2).parents.tolist() == [-1, -1, 0, 0, 1, 1]


@pytest.mark.parametrize("k_config", [[3, 2, 1, 2], [1], [2, 2]])
def test_sliced_masks_equal_fresh_masks_at_every_depth(k_config: list[int]) -> None:
    """The tree drafted to any depth (any prefix, even mid-level) gets the mask a fresh build gives."""
    shape = largest_tree(k_config, 4)
    rng = np.random.default_rng(0)
    for n in range(shape.num_nodes + 1):
        tokens = rng.integers(0, 100, n)
        sliced = shape.with_tokens(tokens)
        fresh = DraftTree(tokens, shape.parents[:n])
        assert np.array_equal(sliced.ancestor_mask, fresh.ancestor_mask)
        assert np.array_equal(sliced.depths, fresh.depths)
        assert sliced.parents.tolist() == fresh.parents.tolist()


# ---------------------------------------------------------------- the drafter on a fake runtime
def path_logits(path: tuple[int, ...], confident_below: int) -> torch.Tensor:
    """A fixed function of the drafted path: peaked while the path is shorter than
    ``confident_below`` (top-1 probability about 0.99), flat after (1 / VOCAB)."""
    generator = torch.Generator().manual_seed(hash(path) % (2**31))
    logits = torch.randn(VOCAB, generator=generator)
    if len(path) < confident_below:
        logits[int(torch.randint(VOCAB, (1,), generator=generator))] += 12.0
        return logits
    return torch.zeros(VOCAB)


class FakeRuntime:
    """The DraftRuntime API over :func:`path_logits`; records what it was fed."""

    def __init__(self, confident_below: int = 99) -> None:
        self.confident_below = confident_below
        self.paths: dict[str, list[tuple[int, ...]]] = {}
        self.fed: list[int] = []
        #: committed tokens the draft lacks, by request (planted: steps it sat out)
        self.lags: dict[str, int] = {}

    @property
    def live_requests(self) -> int:
        return len(self.paths)

    def sync_rows(self, req_id, token_ids):
        return 1 + self.lags.get(req_id, 0)

    def sync_many(self, requests):
        for req_id, _, _ in requests:
            self.paths[req_id] = []
        return [path_logits((), self.confident_below) for _ in requests]

    def extend_many(self, nodes):
        out = []
        for req_id, tokens, parents in nodes:
            paths = self.paths[req_id]
            for token, parent in zip(tokens, parents):
                paths.append((() if parent < 0 else paths[parent]) + (int(token),))
            self.fed.append(len(tokens))
            out.append(torch.stack([path_logits(p, self.confident_below) for p in paths[-len(tokens) :]]))
        return out

    def remove(self, req_ids):
        for req_id in req_ids:
            self.paths.pop(req_id, None)


def options(**overrides) -> dict:
    return checked_options(
        McsdDrafter,
        **{"draft_model": "draft", "num_speculative_tokens": 4, "max_nodes": 64, "lookup": "off", **overrides},
    )


def drafter(runtime: FakeRuntime, **overrides) -> McsdDrafter:
    d = McsdDrafter(options(**overrides))
    d.use_runtime(runtime)
    return d


def request(d: McsdDrafter, tokens: list[int], temperature: float = 0.0, **overrides) -> DraftRequest:
    return DraftRequest("r", np.asarray(tokens), {**d.options, **overrides}, temperature)


def node_path(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(int(tree.tokens[n]) for n in tree.path_to(node))


def test_greedy_tree_holds_each_nodes_top_k() -> None:
    d = drafter(FakeRuntime(), k_config=[3, 2], stop_threshold=0.0)
    tree = d.propose([request(d, [5, 6])])[0]
    assert tree.parents.tolist() == largest_tree([3, 2], 4).parents.tolist()
    assert tree.draft_probs is None  # greedy: the tree verifier reads tokens only
    for node in range(tree.num_nodes):
        parent = int(tree.parents[node])
        siblings = tree.children(parent)
        parent_path = () if parent < 0 else node_path(tree, parent)
        expected = torch.topk(path_logits(parent_path, 99), len(siblings)).indices.tolist()
        assert [int(tree.tokens[s]) for s in siblings] == expected


def test_depth_stops_where_the_draft_is_unsure() -> None:
    """Rows are confident up to depth 2: the default rule (top-1 probability >= 0.5)
    drafts levels 1-2 and stops; threshold 0 drafts all 4 levels."""
    runtime = FakeRuntime(confident_below=2)
    stopped = drafter(runtime, k_config=[2, 2])
    tree = stopped.propose([request(stopped, [5, 6])])[0]
    assert tree.max_depth == 2 and tree.num_nodes == 2 + 4
    assert runtime.fed == [2, 4]  # level 2's rows were fed to score them, level 3 never drafted
    full = drafter(FakeRuntime(confident_below=2), k_config=[2, 2])
    assert full.propose([request(full, [5, 6], stop_threshold=0.0)])[0].max_depth == 4


def test_a_stop_model_decides_the_depth() -> None:
    """A stop model that always says "rejected" stops after the first level, whatever the draft's confidence."""
    d = drafter(FakeRuntime(), k_config=[2])
    d.stop_model = stopping.StopModel()
    with torch.no_grad():
        for parameter in d.stop_model.parameters():
            parameter.zero_()
        list(d.stop_model.parameters())[-1].fill_(-20.0)  # the output bias: sigmoid ~ 0
    assert d.propose([request(d, [5, 6])])[0].max_depth == 1


def test_sampled_children_are_distinct_draws_carrying_their_q() -> None:
    d = drafter(FakeRuntime(confident_below=0), k_config=[4, 3], stop_threshold=0.0)
    tree = d.propose([request(d, [5, 6], temperature=1.0)])[0]
    assert tree.num_nodes == sum(level_sizes([4, 3], 4))
    for parent in [-1, *range(tree.num_nodes)]:
        siblings = tree.children(parent)
        tokens = [int(tree.tokens[s]) for s in siblings]
        assert len(set(tokens)) == len(tokens)  # without replacement
        parent_path = () if parent < 0 else node_path(tree, parent)
        for s in siblings:
            expected = torch.softmax(path_logits(parent_path, 0), -1).numpy()
            np.testing.assert_allclose(tree.draft_probs[s], expected, rtol=1e-6)


def test_collected_rows_are_labelled_by_the_committed_tokens() -> None:
    """A chain of depth 3 scores the root row and levels 1-2; the next step's
    tokens accept two nodes and replace the third: labels 1, 1, 0."""
    d = drafter(FakeRuntime(), k_config=[1], num_speculative_tokens=3, stop_threshold=0.0)
    collector = install_collector(d)
    tree = d.propose([request(d, [5, 6])])[0]
    a, b, c = tree.tokens.tolist()
    other = (c + 1) % VOCAB
    d.propose([request(d, [5, 6, a, b, other])])
    data = collector.take()
    assert data.labels.tolist() == [1.0, 1.0, 0.0]
    assert data.depths.tolist() == [1, 2, 3]
    assert data.features.shape == (3, stopping.NUM_FEATURES)
    assert collector.take().labels.size == 0
    # a row off the committed path is not a sample: its child was never tested
    tree = d.propose([request(d, [5, 6, a, b, other])])[0]
    d.propose([request(d, [5, 6, a, b, other, (int(tree.tokens[0]) + 1) % VOCAB])])
    assert collector.take().labels.tolist() == [0.0]
    # a request that left the batch leaves no rows waiting for its next step
    d.remove_requests(["r"])
    assert not collector.pending


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"k_config": []}, "non-empty list"),
        ({"k_config": [2, 0]}, r"in \[1, 32\]"),
        ({"k_config": ["2"]}, "non-empty list"),
        ({"k_config": [1, 1, 1, 1, 1]}, "shorten k_config or raise num_speculative_tokens"),
        ({"k_config": [4, 4], "max_nodes": 16}, "raise max_nodes to 52"),
    ],
)
def test_bad_k_config_names_the_fix(overrides: dict, message: str) -> None:
    with pytest.raises(SpecbeamConfigError, match=message):
        options(**overrides)


# ---------------------------------------------------------------- inside vLLM
CHAIN = {"k_config": [1]}  # the target-initialised shape [1, 1, ...]: see the drafter's docstring


def with_args(params, extra_args: dict | None):
    params.extra_args = extra_args
    return params


@pytest.fixture(scope="module")
def mcsd(engines, near_draft):
    return engines.get({**MCSD, "model": near_draft})


@pytest.mark.parametrize("extra_args", [None, CHAIN, {"stop_threshold": 0.0}], ids=["k22", "chain", "full-depth"])
def test_greedy_equals_no_speculation(mcsd, prompts, reference, extra_args) -> None:
    before = runner_stats(mcsd)
    assert token_ids(mcsd.generate(prompts, with_args(greedy(), extra_args))) == reference
    if extra_args is None:  # the default trees, without batch neighbours too
        one_at_a_time = [token_ids(mcsd.generate([p], greedy()))[0] for p in prompts[:3]]
        assert one_at_a_time == reference[:3]
    after = runner_stats(mcsd)
    trees = after["trees"] - before["trees"]
    assert trees > 0 and after["accepted"] > before["accepted"]
    depth_sum = after["depth_sum"] - before["depth_sum"]
    depth = depth_sum / trees
    if extra_args == {"stop_threshold": 0.0}:
        # every tree full depth, except where a request's max_tokens leaves fewer tokens:
        # at most D - 1 trees per request at its end, each at least 1 deep
        full = MCSD["num_speculative_tokens"]
        assert full * trees - (full - 1) ** 2 * (len(prompts) + 3) <= depth_sum <= full * trees
    else:
        assert 1 <= depth < MCSD["num_speculative_tokens"], "the stopping rule never stopped early"
    if extra_args is None:  # a second candidate was accepted: the tree paid off
        assert after["accepted_off_first_branch"] > before["accepted_off_first_branch"]


@pytest.mark.parametrize("extra_args", [None, CHAIN], ids=["k22", "chain"])
def test_sampling_matches_the_target(engines, mcsd, prompts, extra_args) -> None:
    """test_sampling_engine's per-position statistic against the session's samples without speculation."""
    prompt = prompts[6]
    before = runner_stats(mcsd)
    ours = sample_sequences(mcsd, prompt, 1.0, extra_args=extra_args)
    after = runner_stats(mcsd)
    assert after["trees"] > before["trees"] and after["accepted"] > before["accepted"]
    assert prefix_homogeneity(ours, target_samples(engines, prompt, 1.0)) > ALPHA


@pytest.fixture(scope="module")
def stop_model_dir(tiny_model: str, near_draft: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``vllm-specbeam mcsd train`` on the tiny pair, from a prompt file unlike the tests'."""
    from vllm_specbeam.adapter import cli

    folder = tmp_path_factory.mktemp("stop-model")
    prompt_file = folder / "train.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in make_prompts(8, seed=7)))
    engine_args = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": KV_CACHE_BYTES, "enforce_eager": True}
    argv = ["mcsd", "train", "--target", tiny_model, "--draft", near_draft, "--prompts", str(prompt_file)]
    argv += ["--out", str(folder / "out"), "--max-tokens", "40", "--dtype", "float32"]
    assert cli.main([*argv, "--engine-args", json.dumps(engine_args)]) == 0
    return folder / "out"


@pytest.mark.engine  # the training command collects with an engine
def test_train_writes_a_small_stop_model_for_the_pair(
    stop_model_dir: Path, tiny_model: str, near_draft: str, tmp_path: Path
) -> None:
    from vllm_specbeam.adapter import cli
    from vllm_specbeam.adapter.mcsd_train import DATA_FILE

    path = stop_model_dir / stopping.STOP_MODEL_FILE
    assert path.stat().st_size < 16 * 1024
    record = json.loads(path.read_text())
    assert record["report"]["rows"] > 100
    stopping.load_stop_model(stop_model_dir, stopping.PairIdentity.of(tiny_model, near_draft))
    # the collected rows are kept: retraining needs no engine and gives the same model for the same seed
    argv = ["mcsd", "train", "--target", tiny_model, "--draft", near_draft, "--out", str(tmp_path)]
    assert cli.main([*argv, "--from-data", str(stop_model_dir / DATA_FILE)]) == 0
    again = json.loads((tmp_path / stopping.STOP_MODEL_FILE).read_text())
    assert again["layers"] == record["layers"]


def depths_drafted(llm, prompts: list[str]) -> tuple[list[list[int]], int, int]:
    """Greedy outputs of ``prompts``, and the trees verified and their depths summed meanwhile."""
    before = runner_stats(llm)
    outputs = token_ids(llm.generate(prompts, greedy()))
    after = runner_stats(llm)
    return outputs, after["trees"] - before["trees"], after["depth_sum"] - before["depth_sum"]


def test_a_stop_model_engine_is_greedy_exact(engines, mcsd, near_draft, stop_model_dir, prompts, reference) -> None:
    """The stop model decides the depth: the same requests draft other depths than under the
    default rule (the engine without it), and the output stays greedy decoding."""
    llm = engines.get({**MCSD, "model": near_draft, "stop_model": str(stop_model_dir)})
    outputs, trees, depth_sum = depths_drafted(llm, prompts[:6])
    assert outputs == reference[:6] and trees > 0
    without = depths_drafted(mcsd, prompts[:6])
    assert without[0] == reference[:6]
    assert (trees, depth_sum) != without[1:], "the stop model drafted the default rule's depths: was it used?"


@pytest.mark.engine
def test_a_stop_model_for_another_pair_is_refused(tiny_model, stop_model_dir, tmp_path) -> None:
    """Refused in the front end, before an engine starts: the draft has another shape."""
    from tiny_model import build_tiny_model
    from vllm import LLM

    other = str(build_tiny_model(tmp_path / "other-draft", seed=1, num_hidden_layers=3))
    with pytest.raises(SpecbeamConfigError, match="trained for"):
        LLM(tiny_model, speculative_config={**MCSD, "model": other, "stop_model": str(stop_model_dir)})
