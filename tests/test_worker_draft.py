"""The in-worker draft model (adapter/draft_model.py): vLLM loads it, its K/V live in vLLM's paged cache.

The draft's K/V shape differs from the target's (3 layers of 4 KV heads of
size 64 against 2 layers of 2 heads of size 32), so it gets its own attention
group in the target's one KV group. Its embeddings and head are the target's,
so its drafts are often accepted and sometimes not: the engine steps mix
acceptances and rejections, and every later draft must still be right
(the rollback to the committed tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from conftest import KV_CACHE_BYTES, greedy, runner_stats, token_ids, tree_path
from specs import LOOKUP, MCSD

#: float32, the CPU attention kernel against transformers' SDPA (docs/draft-runtime.md Q2: up to 2e-4)
ATOL = 5e-4
DRAFT_SHAPE = {"num_hidden_layers": 3, "num_key_value_heads": 4, "head_dim": 64}


@pytest.fixture(scope="module")
def wide_draft(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Same tokenizer, embeddings and head as the target; other attention shapes and weights."""
    from tiny_model import build_tiny_model
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-wide-draft"), seed=1, **DRAFT_SHAPE)
    target = AutoModelForCausalLM.from_pretrained(tiny_model)
    draft = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
    draft.save_pretrained(path, safe_serialization=True)
    # the premise of the tests below: another K/V shape and layer count than the target's
    assert _page_bytes(str(path)) != _page_bytes(tiny_model)
    return str(path)


def _record(worker, runtime_name: str = "draft_runtime") -> None:
    """Log every call of one of the worker's draft runtimes with its logits."""
    runtime = getattr(worker.model_runner, runtime_name)
    runtime.calls = []
    sync_many, extend_many = runtime.sync_many, runtime.extend_many

    def sync(requests):
        results = sync_many(requests)
        runtime.calls += [("sync", r, list(map(int, t)), None, x) for (r, t, _), x in zip(requests, results)]
        return results

    def extend(nodes):
        results = extend_many(nodes)
        runtime.calls += [("extend", r, list(t), list(p), x) for (r, t, p), x in zip(nodes, results)]
        return results

    runtime.sync_many, runtime.extend_many = sync, extend


@dataclass
class _LoggedCall:
    """One logged draft call: its rows' logits and the plain sequences they must equal."""

    kind: str  # "sync" (committed tokens) or "extend" (tree nodes)
    context: list[int]  # the request's committed tokens
    tokens: list[int]
    parents: list[int]  # tree calls: each node's parent (within the request's tree this step)
    first: int  # tree calls: index of the call's first node in that tree
    sequences: list[list[int]]  # per row: the committed tokens and the row's path
    rows: torch.Tensor  # [len(sequences), vocab]


def _logged_calls(worker, runtime_name: str) -> Iterator[_LoggedCall]:
    """The worker's logged draft calls (``_record``), each row paired with its plain sequence."""
    context: dict[str, list[int]] = {}
    trees: dict[str, list[tuple[int, int]]] = {}
    for kind, req_id, tokens, parents, logits in getattr(worker.model_runner, runtime_name).calls:
        if kind == "sync":
            context[req_id], trees[req_id] = tokens, []
            if logits is not None:
                yield _LoggedCall(kind, tokens, tokens, [], 0, [tokens], logits[None])
            continue
        first = len(trees[req_id])
        trees[req_id] += zip(tokens, parents)
        sequences = [context[req_id] + tree_path(trees[req_id], first + i) for i in range(len(tokens))]
        yield _LoggedCall(kind, context[req_id], tokens, parents, first, sequences, logits)


def _check(worker, draft: str, runtime_name: str = "draft_runtime") -> dict:
    """Each logged logit row against transformers on the same tokens as a plain sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    worst = {"sync": 0.0, "extend": 0.0}
    counts = {"sync": 0, "extend": 0, "branching_depths": 0, "chain_depths": 0}
    for call in _logged_calls(worker, runtime_name):
        if call.kind == "extend":
            counts["branching_depths"] += len(set(call.parents)) < len(call.parents)
            # causal rows, no mask
            counts["chain_depths"] += len(call.tokens) == 1 and call.parents[0] == call.first - 1 >= 0
        with torch.inference_mode():
            for sequence, row in zip(call.sequences, call.rows):
                reference = model(torch.tensor([sequence])).logits[0, -1]
                worst[call.kind] = max(worst[call.kind], float((row - reference).abs().max()))
                counts[call.kind] += 1
    return {"worst": worst, "counts": counts, "stats": dict(worker.model_runner.tree_stats)}


def _unpriced(worker) -> None:
    """Leave the drafter unpriced: its chains draft their full depth whatever a row costs (the
    logits are checked here, not the controller)."""
    worker.model_runner.tree_drafter.plan_step = lambda prices: None


def _draft_compiled(worker) -> bool:
    # vLLM 0.32.0 compilation/decorators.py: set on the decorated decoder once it is compiled
    return bool(getattr(worker.model_runner.draft_runtime.draft.model.model, "compiled", False))


def _counter(llm, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


def _num_blocks(worker) -> int:
    return worker.model_runner.kv_cache_config.num_blocks


def _page_bytes(model: str, dtype_bytes: int = 4) -> int:
    """Bytes one 128-token block takes in all of a model's layers (K and V)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * dtype_bytes * 128


#: compiled (``enforce_eager=False``): the draft's compilation at warm-up is checked here
COMPILED = {"enforce_eager": False}


def test_tree_logits_match_transformers_over_steps(engines, tiny_model: str, wide_draft: str, prompts) -> None:
    from vllm import SamplingParams

    spec = {"method": "dsbd", "model": wide_draft, "num_speculative_tokens": 3, "max_nodes": 8, "max_width": 2}
    spec = {**spec, "prune_ratio": 0.0}  # unpruned: two branches at every depth
    llm = engines.get(spec, **COMPILED)
    # Compiled at start-up (the worker's warm-up), not in the first request's step.
    assert llm.collective_rpc(_draft_compiled) == [True]
    llm.collective_rpc(_record)
    llm.collective_rpc(_unpriced)
    before = runner_stats(llm)
    prompts = [prompts[i] for i in (1, 6, 8)]  # 9, 140, 260 words: contexts cross block boundaries
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=3)
    chain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, extra_args={"max_width": 1})
    llm.generate(prompts + prompts[:2] + prompts[1:2], [greedy] * 3 + [sampled] * 2 + [chain])
    # A later request sharing the longest prompt's first blocks starts from a prefix-cache
    # hit: the draft's K/V of those blocks come from the earlier request.
    hits = _counter(llm, "vllm:prefix_cache_hits")
    llm.generate([prompts[2] + " and then some more words"], greedy)
    assert _counter(llm, "vllm:prefix_cache_hits") - hits >= 128
    result = llm.collective_rpc(_check, args=(wide_draft,))[0]
    stats = {name: result["stats"][name] - before[name] for name in before if isinstance(before[name], int)}
    counts = result["counts"]
    assert stats["accepted"] > 0 and stats["nodes"] > stats["accepted"]  # acceptances and rejections
    # Accepted nodes' draft K/V were kept, some moved to their committed slots (the sync rows above prove them)
    assert stats["draft_kv_kept"] > 0 and stats["draft_kv_moves"] > 0
    assert counts["sync"] > 20 and counts["extend"] > 50 and counts["branching_depths"] > 0
    assert counts["chain_depths"] > 10
    assert result["worst"]["sync"] < ATOL and result["worst"]["extend"] < ATOL, result["worst"]

    # One KV group for both models: a block holds both models' K/V of its 128 tokens.
    with_draft = llm.collective_rpc(_num_blocks)[0]
    engines.stop(spec, **COMPILED)  # this test's own engine, logging every draft call
    without = engines.get(LOOKUP)  # a method without a draft model: the target's K/V alone
    assert without.collective_rpc(_num_blocks)[0] == KV_CACHE_BYTES // _page_bytes(tiny_model)
    assert with_draft == KV_CACHE_BYTES // (_page_bytes(tiny_model) + _page_bytes(wide_draft))


#: a step's tokens, the most vLLM compiles a forward for: below each prompt's length here
BATCH_TOKENS = 64


def _log_forwards(worker) -> None:
    """Log the rows of every forward of the engine's draft (``forward_rows``), and per ``sync_many``
    call the requests it answered, its forwards' rows and the rows ``sync_rows`` foretold (``syncs``)."""
    runtime = worker.model_runner.draft_runtime
    runtime.forward_rows, runtime.syncs, sync_many = [], [], runtime.sync_many
    runtime.draft.model.register_forward_pre_hook(
        lambda _, args, kwargs: runtime.forward_rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )

    def logged(requests):
        first = len(runtime.forward_rows)
        foretold = [runtime.sync_rows(req_id, tokens) for req_id, tokens, _ in requests]
        results = sync_many(requests)
        foretold = sum(rows for rows, result in zip(foretold, results) if result is not None)
        runtime.syncs.append((sum(r is not None for r in results), runtime.forward_rows[first:], foretold))
        return results

    runtime.sync_many = logged


def _forwards(worker) -> dict:
    runtime = worker.model_runner.draft_runtime
    return {"rows": runtime.forward_rows, "syncs": runtime.syncs}


def _defer_until_decoding(worker, batch: int) -> None:
    """The lookup leaves the draft nothing (every request defers, its prompt unfed) until ``batch``
    requests decode together: their first sync catches the draft up on all their prompts at once."""
    lookup = worker.model_runner.tree_drafter.lookup
    split, opened = lookup.split, [False]

    def gated(requests, fills, **kwargs):
        opened[0] = opened[0] or len(requests) == batch
        splits = split(requests, fills, **kwargs)
        return splits if opened[0] else [replace(s, fill_nodes=0) for s in splits]

    lookup.split = gated


def test_a_catch_up_on_long_prompts_runs_in_forwards_within_max_num_batched_tokens(
    engines, wide_draft: str, prompts, reference
) -> None:
    """Issue #56: a drafter with lookup branches feeds its draft at its syncs only, so a sync can
    catch up on whole prompts: here of 200 to 300 tokens, several in one call. Its rows run in
    forwards of at most ``max_num_batched_tokens``, the shapes vLLM compiled the draft for, each
    prompt cut across forwards that also hold the others'; every sync's logits equal transformers'."""
    spec = {**MCSD, "model": wide_draft, "lookup": "global"}
    llm = engines.get(spec, max_num_batched_tokens=BATCH_TOKENS)
    prompts, reference = prompts[7:], reference[7:]  # 200, 260 and 300 words
    llm.collective_rpc(_log_forwards)
    llm.collective_rpc(_record)
    llm.collective_rpc(_defer_until_decoding, args=(len(prompts),))
    assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == reference
    forwards = llm.collective_rpc(_forwards)[0]
    assert max(forwards["rows"]) == BATCH_TOKENS, forwards["rows"]
    # every prompt caught up in a sync of several forwards, one such sync for several prompts
    caught_up = [requests for requests, rows, _ in forwards["syncs"] if len(rows) > 1]
    assert sum(caught_up) == len(prompts) and max(caught_up) > 1, forwards["syncs"]
    # what the gate prices a request's share of a sync at is what the sync fed (kept nodes, catch-ups)
    assert all(sum(rows) == foretold for _, rows, foretold in forwards["syncs"]), forwards["syncs"]
    result = llm.collective_rpc(_check, args=(wide_draft,))[0]
    assert result["counts"]["sync"] > len(prompts), result
    assert result["worst"]["sync"] < ATOL and result["worst"]["extend"] < ATOL, result["worst"]
    engines.stop(spec, max_num_batched_tokens=BATCH_TOKENS)  # this test's own engine, logging every draft call


def _search_pool(worker) -> dict:
    runtime = worker.model_runner.search_draft_runtime
    return {"keys": len(runtime.pool.key_blocks), "blocks": runtime.pool.num_blocks, "live": runtime.live_requests}


def _count_sync_rows(worker) -> None:
    """Count the rows the engine's draft is fed after each step (``sync_step``) in ``rows_after_steps``."""
    runtime, counts = worker.model_runner.draft_runtime, worker.model_runner.tree_counts
    runtime.rows_after_steps, sync_step = 0, runtime.sync_step

    def counted() -> None:
        before = counts.draft_rows
        sync_step()
        runtime.rows_after_steps += counts.draft_rows - before

    runtime.sync_step = counted


def _sync_rows(worker) -> int:
    return worker.model_runner.draft_runtime.rows_after_steps


def test_beam_search_drafts_in_the_worker_with_exact_logits_and_frees_its_blocks(
    engines, wide_draft: str, prompts
) -> None:
    """The speculative beam search drafts on the engine's own draft in the worker, its K/V in
    blocks of its own: every row (prefixes, beams' tails fed as one tree, drafted depths, over
    rounds) equals transformers on the plain sequence, and the blocks go when the search ends.

    The engine's own draft is fed none of the scoring requests' tree rows (their blocks serve no
    later request), yet a later request hitting the blocks of their shared prefix drafts exactly."""
    from vllm import SamplingParams
    from vllm.sampling_params import BeamSearchParams

    from vllm_specbeam.adapter.beam_search import SpeculativeBeamSearch, WorkerForests

    spec = {"method": "dsbd", "model": wide_draft, "num_speculative_tokens": 3}
    llm = engines.get(spec, enable_prefix_caching=True)
    search = SpeculativeBeamSearch(llm)
    assert isinstance(search.forests, WorkerForests)  # no draft in this process
    llm.collective_rpc(_record, args=("search_draft_runtime",))
    llm.collective_rpc(_count_sync_rows)
    prompts = [prompts[i] for i in (1, 6, 8)]  # 9, 140, 260 words: contexts cross block boundaries
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    ours = search.run(prompts, params)
    # fed before: every row the target computed, trees included (scored_rows counts both)
    assert 0 < llm.collective_rpc(_sync_rows)[0] <= search.stats.scored_rows - search.stats.draft_nodes
    assert [[s.tokens for s in o.sequences] for o in ours] == [
        [s.tokens for s in o.sequences] for o in llm.beam_search(prompts, params)
    ]
    result = llm.collective_rpc(_check, args=(wide_draft, "search_draft_runtime"))[0]
    counts = result["counts"]
    assert counts["sync"] >= 2 * len(prompts) and counts["extend"] > 50 and counts["branching_depths"] > 0
    assert result["worst"]["sync"] < ATOL and result["worst"]["extend"] < ATOL, result["worst"]
    assert search.stats.rounds > 1 and search.stats.draft_nodes > 0
    assert llm.collective_rpc(_search_pool) == [{"keys": 0, "blocks": 0, "live": 0}]

    llm.collective_rpc(_record)
    later = llm.generate([prompts[2] + " and then some more"], SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert later.num_cached_tokens > 0  # blocks a scoring request computed
    result = llm.collective_rpc(_check, args=(wide_draft,))[0]
    assert result["counts"]["sync"] > 0 and result["counts"]["extend"] > 0
    assert result["worst"]["sync"] < ATOL and result["worst"]["extend"] < ATOL, result["worst"]
    engines.stop(spec, enable_prefix_caching=True)  # this test's own engine, logging every draft call


def test_bfloat16_draft_of_a_float32_target_is_greedy_exact(
    engines, tiny_model: str, wide_draft: str, prompts, reference
) -> None:
    """``draft_dtype``: the draft's layers keep their K/V in their own dtype within the target's blocks."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts, reference = prompts[:6], [r[:32] for r in reference[:6]]  # greedy: a prefix of the longer reference
    spec = {"method": "dsbd", "model": wide_draft, "num_speculative_tokens": 3, "max_nodes": 3, "max_width": 1}
    llm = engines.get({**spec, "draft_dtype": "bfloat16"})
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] == reference
    assert llm.collective_rpc(_draft_dtype)[0] == "torch.bfloat16"
    assert llm.collective_rpc(_num_blocks)[0] == KV_CACHE_BYTES // (
        _page_bytes(tiny_model) + _page_bytes(wide_draft, dtype_bytes=2)
    )


def _draft_dtype(worker) -> str:
    return str(next(worker.model_runner.draft_runtime.draft.model.parameters()).dtype)


def _check_vocabulary(worker, draft: str, kept: list[int]) -> dict:
    """Each logged row is finite exactly on the vocabulary and its request's own tokens, equal to transformers there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    worst, rows_checked, own_columns = 0.0, 0, 0
    for call in _logged_calls(worker, "draft_runtime"):
        columns = sorted(set(kept) | set(call.context))
        own_columns = max(own_columns, len(columns) - len(kept))
        with torch.inference_mode():
            for sequence, row in zip(call.sequences, call.rows):
                assert torch.isfinite(row).nonzero().flatten().tolist() == columns
                reference = model(torch.tensor([sequence])).logits[0, -1]
                worst = max(worst, float((row[columns] - reference[columns]).abs().max()))
                rows_checked += 1
    return {"worst": worst, "rows": rows_checked, "own_columns": own_columns}


def test_draft_vocabulary_scores_its_tokens_and_each_requests_own(
    engines, tiny_model: str, wide_draft: str, tmp_path: Path, prompts, reference
) -> None:
    """``draft_vocab``: the draft's logits are the full head's on the vocabulary plus the request's
    context tokens and ``-inf`` elsewhere; verification is unchanged, so greedy output stays exact."""
    from vllm import SamplingParams

    from vllm_specbeam.core.corpus import load_tokenizer
    from vllm_specbeam.draft_runtime import vocab

    (tmp_path / "corpus.txt").write_text(" ".join(f"w{i}" for i in range(40) for _ in range(40 - i)))
    path = vocab.build([tmp_path / "corpus.txt"], load_tokenizer(tiny_model), size=30, progress=False).save(
        tmp_path / "vocab"
    )
    kept = vocab.load(path).ids.tolist()  # w0..w29 and the 3 special tokens, of 103
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts, reference = [prompts[i] for i in (1, 4, 6)], [reference[i][:24] for i in (1, 4, 6)]
    spec = {**MCSD, "model": wide_draft, "draft_vocab": str(path)}
    llm = engines.get(spec)
    llm.collective_rpc(_record)
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] == reference
    result = llm.collective_rpc(_check_vocabulary, args=(wide_draft, kept))[0]
    assert result["rows"] > 30 and result["own_columns"] > 20  # the prompts hold many words past w29
    assert result["worst"] < ATOL, result
    engines.stop(spec)  # this test's own engine, logging every draft call
