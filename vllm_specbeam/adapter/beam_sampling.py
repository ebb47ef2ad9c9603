"""Full-width beam sampling on a vLLM engine: the target-only reference and DSBD's speculative version.

Both draw, at every step, ``W`` (beam, token) pairs i.i.d. from the joint of
:mod:`vllm_specbeam.methods.dsbd.beam_sampling` (temperature on the joint,
top-k / top-p cutting each beam's row) and return the ``W`` best beams by
vLLM's length-normalised beam score.

* :class:`BeamSampling`: the reference, the target alone, one engine step per
  token (as vLLM's ``LLM.beam_search``); ``hf=True``: Hugging Face's law instead
  (``2W`` drawn without replacement, the ``W`` best kept).
* :class:`SpeculativeBeamSampling`: rounds of :class:`SpeculativeBeamSearch`
  (``W`` target beams kept through the prefix cache, the forest scored as tree
  prompts in one target pass), drafted by the engine's draft in beam-sampling
  mode (``specbeam_sample_forests``) and verified depth by depth by
  :func:`~vllm_specbeam.methods.dsbd.beam_sampling.speculative_depth`.

**Exact rows.** vLLM returns each row's top ``N`` raw logprobs (engine
``logprobs_mode="raw_logprobs"``, the default). A row's kept tokens are decided
from them when top-k is at most ``N``, or when the top ``N`` decide the top-p
nucleus whatever the unseen tokens hold
(:func:`~vllm_specbeam.methods.dsbd.beam_sampling.kept_count`); else the
sampler refuses with :class:`InexactBeamSamplingError`, naming the fix.
``N`` is ``top_k`` when set, else the engine's ``max_logprobs``.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from vllm_specbeam.adapter.beam_search import PromptSearch, Selection, SpeculativeBeamSearch, priorities
from vllm_specbeam.core.config import SpecbeamConfigError
from vllm_specbeam.core.tree import ROOT, DraftTree
from vllm_specbeam.methods.dsbd import beam_sampling as law_maths
from vllm_specbeam.methods.dsbd.beam_sampling import SamplingLaw, SparseRows

_RUNS = itertools.count()


class InexactBeamSamplingError(ValueError):
    """The target's rows cannot be read exactly for this request (the message names the fix)."""


@dataclass(frozen=True)
class BeamSamplingParams:
    """A beam-sampling request (vLLM's ``BeamSearchParams`` plus the row cuts and a seed)."""

    beam_width: int
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    ignore_eos: bool = False
    length_penalty: float = 1.0
    #: makes the beams reproducible (``None``: fresh randomness)
    seed: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.beam_width < 1 or self.max_tokens < 1:
            raise ValueError("beam_width and max_tokens must be at least 1")

    @property
    def law(self) -> SamplingLaw:
        return SamplingLaw(self.temperature, self.top_k, self.top_p)


@dataclass
class BeamSamplingStats:
    """Counts over every call of one :class:`SpeculativeBeamSampling`."""

    #: accepted pairs, summed over prompt-rounds, per depth (index 0: the first drafted depth)
    accepted_per_depth: list[int] = field(default_factory=list)


@dataclass
class PromptSampling(PromptSearch):
    """One prompt's beam sampling: the search state plus its own random stream."""

    generator: torch.Generator = field(default_factory=torch.Generator)
    #: this round's draft, as the worker returned it (:meth:`SpeculativeBeamSampling.draft_round`)
    forest: _Forest | None = None


@dataclass(frozen=True)
class _Forest:
    """A round's beam-sampling draft for one prompt: nodes in draw order over all target beams."""

    tokens: list[int]
    #: a node's parent node, or ``-1 - b`` below target beam ``b``
    parents: list[int]
    #: the draft's joint score of every node (``-inf``: an EOS pair, never extended)
    scores: list[float]
    #: the cut rows the draft drew from: per target beam, then per fed node
    rows: SparseRows

    @classmethod
    def read(cls, data: list[Any]) -> _Forest:
        """From :meth:`~vllm_specbeam.methods.dsbd.drafter.JointBeamSample.sampled_forest`'s data."""
        tokens, parents, scores, rows = data or [[], [], [], [b""] * 3]
        return cls(tokens, parents, scores, SparseRows.from_data(rows))

    def depths(self) -> list[int]:
        """Each node's depth (0: below a target beam)."""
        out: list[int] = []
        for parent in self.parents:
            out.append(0 if parent < 0 else out[parent] + 1)
        return out

    def beam_trees(self, num_beams: int) -> tuple[list[DraftTree], list[int]]:
        """One tree per target beam (for the tree prompts), and each node's index in its tree."""
        beam_of: list[int] = []
        local: list[int] = []
        paths: list[list[tuple[int, int]]] = [[] for _ in range(num_beams)]  # (token, local parent)
        for token, parent in zip(self.tokens, self.parents):
            beam_of.append(-1 - parent if parent < 0 else beam_of[parent])
            local.append(len(paths[beam_of[-1]]))
            paths[beam_of[-1]].append((token, ROOT if parent < 0 else local[parent]))
        trees = [
            DraftTree(np.asarray([t for t, _ in p], np.int64), np.asarray([q for _, q in p], np.int64)) for p in paths
        ]
        return trees, local


# ---------------------------------------------------------------- exact rows
def engine_logprobs(vllm_config: Any, law: SamplingLaw) -> int:
    """``N``, the logprobs to ask per row (see the module docstring); refuses engines whose
    logprobs are not raw and top-k beyond ``max_logprobs``."""
    # vLLM 0.32.0 config/model.py: ModelConfig.logprobs_mode, max_logprobs (-1: the vocabulary)
    model = vllm_config.model_config
    if model.logprobs_mode != "raw_logprobs":
        raise SpecbeamConfigError(
            f"beam sampling reads raw logprobs, but the engine returns {model.logprobs_mode}: "
            "start it with logprobs_mode='raw_logprobs' (the default)"
        )
    vocab = model.get_vocab_size()
    cap = vocab if model.max_logprobs < 0 else min(model.max_logprobs, vocab)
    if law.row_cap is None and law.top_p == 1 and cap < vocab:
        raise InexactBeamSamplingError(
            f"beam sampling without top_k or top_p keeps every token of a row, but the engine returns "
            f"{cap} logprobs per row of {vocab}: set top_k <= {cap} or top_p < 1, or start the engine "
            "with max_logprobs=-1"
        )
    if law.top_k > cap and cap < vocab:
        raise InexactBeamSamplingError(
            f"top_k={law.top_k} needs {law.top_k} logprobs per row but the engine returns at most {cap}: "
            f"start it with max_logprobs={law.top_k} (or -1), or lower top_k"
        )
    return min(law.top_k, cap) if law.top_k > 0 else cap


def exact_rows(logprobs: Sequence[dict[int, Any]], num_logprobs: int, vocab: int, law: SamplingLaw) -> torch.Tensor:
    """``[L, V]`` float64: each row's kept tokens at their raw logprobs, ``-inf`` elsewhere, from
    vLLM's logprobs dicts (their top ``num_logprobs`` by rank; a prompt row also holds the next
    prompt token). Refuses a row its logprobs do not decide."""
    tops = [sorted((lp.rank, t, lp.logprob) for t, lp in row.items() if lp.rank <= num_logprobs) for row in logprobs]
    tokens = torch.tensor([[t for _, t, _ in top] for top in tops], dtype=torch.int64)  # [L, N]
    values = torch.tensor([[v for _, _, v in top] for top in tops], dtype=torch.float64)  # [L, N], descending
    kept = law_maths.kept_counts(values, vocab, law)  # [L]
    if bool((kept == law_maths.UNDECIDED).any()):
        raise InexactBeamSamplingError(
            f"the {num_logprobs} logprobs returned for a row do not decide its top_p={law.top_p} nucleus at "
            f"temperature {law.temperature}: set top_k <= {num_logprobs}, a lower top_p, or start the engine "
            "with a larger max_logprobs (-1: the whole vocabulary)"
        )
    cut = torch.arange(values.shape[-1]).unsqueeze(0) >= kept.unsqueeze(-1)  # [L, N]
    out = torch.full((len(tops), vocab), float("-inf"), dtype=torch.float64)
    return out.scatter_(-1, tokens, values.masked_fill(cut, float("-inf")))


# ---------------------------------------------------------------- shared step
def prompt_generators(seed: int | None, count: int) -> list[torch.Generator]:
    """Each prompt's random stream, drawn from ``seed`` (``None``: fresh randomness): the same
    seed gives the same beams, offline or over HTTP."""
    seeds = torch.Generator()
    if seed is None:
        seeds.seed()
    else:
        seeds.manual_seed(seed)
    return [torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=seeds))) for _ in range(count)]


class _Sampler:
    """What both samplers share: prompts, the exact rows, the step that extends beams, the answer."""

    engine: Any

    def _instances(
        self, prompts: Sequence[Any], params: BeamSamplingParams, key: str, priority: int | Sequence[int] | None
    ) -> list[PromptSampling]:
        from vllm.entrypoints.generate.beam_search.utils import BeamSearchInstance

        # vLLM 0.32.0 entrypoints/generate/beam_search/offline.py: LLM.beam_search's preprocessing
        inputs = self.engine._preprocess_cmpl(list(prompts))
        generators = prompt_generators(params.seed, len(inputs))
        return [
            PromptSampling(BeamSearchInstance(prompt), f"{key}-{i}", p, generator=generator)
            for i, (prompt, p, generator) in enumerate(zip(inputs, priorities(priority, len(inputs)), generators))
        ]

    def prepare(self, params: BeamSamplingParams, selection: Selection | None = None) -> None:
        """Per call: the logprobs to ask, and how beams complete and are ranked (``selection``:
        the server's rules; default ``LLM.beam_search``'s)."""
        config = getattr(self.engine, "llm_engine", self.engine).vllm_config
        self.num_logprobs = engine_logprobs(config, params.law)
        self.vocab = config.model_config.get_vocab_size()
        if selection is None:
            fields = self.engine.llm_engine.input_processor.generation_config_fields
            selection = Selection.offline(params, self.engine.get_tokenizer().eos_token_id, fields)
        self.selection = selection

    def _rows(self, logprobs: Sequence[dict[int, Any]], params: BeamSamplingParams) -> torch.Tensor:
        return exact_rows(logprobs, self.num_logprobs, self.vocab, params.law)  # [L, V]

    def _extend(self, inst: PromptSampling, parents: list[Any], rows: torch.Tensor, pairs: list[int]) -> list[int]:
        """Append each drawn pair (``slot * V + token``) to its parent beam; EOS pairs complete.
        Returns the positions in ``pairs`` of those that stay live; ``inst.state.beams`` holds them."""
        from vllm.entrypoints.generate.beam_search.utils import BeamSearchSequence

        live, kept = [], []
        for i, pair in enumerate(pairs):
            slot, token = divmod(pair, self.vocab)
            parent = parents[slot]
            seq = BeamSearchSequence(
                parent.orig_prompt,
                tokens=parent.tokens + [token],
                logprobs=parent.logprobs,
                lora_request=parent.lora_request,
                cum_logprob=parent.cum_logprob + float(rows[slot, token]),
            )
            if token in self.selection.eos:
                inst.state.completed.append(self.selection.complete(seq))
            else:
                live.append(seq)
                kept.append(i)
        inst.state.beams = live
        return kept

    def _outputs(self, instances: list[PromptSampling], params: BeamSamplingParams) -> list[Any]:
        from vllm.entrypoints.generate.beam_search.utils import BeamSearchOutput

        tokenizer = self.engine.get_tokenizer()
        outputs = []
        for inst in instances:
            best = self.selection.best(inst.state)
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens)
            outputs.append(BeamSearchOutput(sequences=best))
        return outputs


# ---------------------------------------------------------------- reference
class BeamSampling(_Sampler):
    """Beam sampling with the target alone: the reference law, one engine step per token."""

    def __init__(self, engine: Any, hf: bool = False) -> None:
        """``hf``: Hugging Face's law (``2W`` without replacement, the ``W`` best kept)."""
        self.engine, self.hf = engine, hf

    def run(
        self, prompts: Sequence[Any], params: BeamSamplingParams, priority: int | Sequence[int] | None = None
    ) -> list[Any]:
        """Each prompt's ``W`` best sampled beams (``priority``: as ``LLM.beam_search`` takes it)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.prepare(params)
        instances = self._instances(prompts, params, f"beam-sampling-{uuid.uuid4().hex[:12]}", priority)
        request = SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.num_logprobs, detokenize=False)
        for _ in range(params.max_tokens):
            active = [inst for inst in instances if inst.state.beams]
            if not active:
                break
            prompts_ = [TokensPrompt(prompt_token_ids=b.tokens) for inst in active for b in inst.state.beams]
            order = [inst.priority for inst in active for _ in inst.state.beams]
            results = iter(self.engine.generate(prompts_, request, use_tqdm=False, priority=order))
            for inst in active:
                rows = self._rows([next(results).outputs[0].logprobs[0] for _ in inst.state.beams], params)
                self._step(inst, rows, params)
        return self._outputs(instances, params)

    def _step(self, inst: PromptSampling, rows: torch.Tensor, params: BeamSamplingParams) -> None:
        scores = torch.tensor([b.cum_logprob for b in inst.state.beams], dtype=torch.float64)
        joint = law_maths.beam_joint(scores, rows, params.law)  # [L * V]
        if not self.hf:
            pairs = law_maths.draw_pairs(joint, params.beam_width, inst.generator).tolist()
            self._extend(inst, list(inst.state.beams), rows, pairs)
            return
        # transformers _beam_search: the W best non-EOS candidates by score live on; EOS ones
        # among the first W drawn complete
        drawn = law_maths.hf_candidates(joint, params.beam_width, inst.generator).tolist()
        eos = self.selection.eos
        ended = [p for p in drawn[: params.beam_width] if p % self.vocab in eos]
        running = sorted((p for p in drawn if p % self.vocab not in eos), key=lambda p: -float(joint[p]))
        self._extend(inst, list(inst.state.beams), rows, ended + running[: params.beam_width])


# ---------------------------------------------------------------- speculative
@dataclass
class _Live:
    """A live beam while a round is verified: its sequence, the target beam it grew from this
    round, its draft node (``None``: the target beam's own end)."""

    seq: Any
    beam: int
    node: int | None


class SpeculativeBeamSampling(_Sampler, SpeculativeBeamSearch):
    """:class:`BeamSampling`'s law, several tokens per target pass (see the module docstring).

    ``draft_width``: pairs drafted per depth (default ``2 * beam_width``); a depth
    succeeds when ``beam_width`` of them pass.
    """

    def __init__(
        self,
        engine: Any,
        num_speculative_tokens: int | None = None,
        draft_width: int | None = None,
        scoring: str = "auto",
    ) -> None:
        SpeculativeBeamSearch.__init__(self, engine, num_speculative_tokens, draft_width, scoring)
        self._keys = f"beam-sampling-{uuid.uuid4().hex[:12]}"
        self.sampling_stats = BeamSamplingStats()

    def run(
        self, prompts: Sequence[Any], params: BeamSamplingParams, priority: int | Sequence[int] | None = None
    ) -> list[Any]:
        """The ``W`` best of each prompt's sampled beams, as :meth:`BeamSampling.run` returns them."""
        self.prepare(params)
        instances = self._instances(prompts, params, self._keys + f"-{next(_RUNS)}", priority)
        try:
            while active := self.active(instances, params):
                requests = self.draft_round(active, params, self.selection.draft_eos)
                prompts_, sampling = zip(*requests)
                results = self.engine.generate(
                    list(prompts_), list(sampling), use_tqdm=False, priority=self.request_priorities(active)
                )
                self.verify_round(active, results, params, None)
        finally:
            self.release(instances)
        return self._outputs(instances, params)

    def _num_logprobs(self, params: Any) -> int:
        return self.num_logprobs

    def draft_round(self, active: list[PromptSearch], params: Any, eos: int | None) -> list[tuple[Any, Any]]:
        """Draft every active prompt's forest by beam sampling in the worker; the scoring requests."""
        data = self.engine.collective_rpc("specbeam_sample_forests", args=self._sample_args(active, params, eos))
        return self._read_forests(active, params, data[0])

    async def draft_round_async(
        self, active: list[PromptSearch], params: Any, eos: int | None
    ) -> list[tuple[Any, Any]]:
        """:meth:`draft_round` for the server's event loop."""
        data = await self.engine.collective_rpc("specbeam_sample_forests", args=self._sample_args(active, params, eos))
        return self._read_forests(active, params, data[0])

    def _sample_args(self, active: list[PromptSearch], params: Any, eos: int | None) -> tuple[Any, ...]:
        """``specbeam_sample_forests``' arguments (plain data); draws each prompt's draft seed."""
        requests = [
            [r.key, r.beams, r.scores, r.depth, int(torch.randint(2**62, (1,), generator=inst.generator))]
            for r, inst in zip(self._forest_requests(active, params), cast(list[PromptSampling], active))
        ]
        law = params.law
        return (requests, self._width(params), [law.temperature, law.top_k, law.top_p], eos)

    def _read_forests(self, active: list[PromptSearch], params: Any, data: list[Any]) -> list[tuple[Any, Any]]:
        trees = []
        for inst, forest in zip(active, data):
            assert isinstance(inst, PromptSampling)
            inst.forest = _Forest.read(forest)
            trees.append(inst.forest.beam_trees(len(inst.state.beams))[0])
        return self._scoring_requests(active, params, trees)

    def _verify(self, inst: PromptSearch, rows: list[list[dict[int, Any]]], params: Any, selection: Any) -> int:
        """Sample depth by depth on the scored rows (``rows[b]``: target beam ``b``'s at its end
        and its tree's nodes); a depth that accepts ``W`` drafted pairs goes on with them as its
        beams, any other ends the round. Returns the steps done."""
        assert isinstance(inst, PromptSampling) and inst.forest is not None
        forest, num_beams = inst.forest, len(inst.state.beams)
        local = forest.beam_trees(num_beams)[1]
        depths = forest.depths()
        live = [_Live(seq, b, None) for b, seq in enumerate(inst.state.beams)]
        steps = 0
        while live and inst.steps + steps < params.max_tokens:
            target = self._rows([rows[f.beam][0 if f.node is None else local[f.node] + 1] for f in live], params)
            scores = torch.tensor([f.seq.cum_logprob for f in live], dtype=torch.float64)
            joint = law_maths.beam_joint(scores, target, params.law)  # [L * V]
            drafted = self._drafted(forest, depths, live, steps)
            if drafted:
                pairs, nodes = self._check_depth(inst, forest, num_beams, live, joint, drafted, params, steps)
            else:
                pairs, nodes = law_maths.draw_pairs(joint, params.beam_width, inst.generator).tolist(), None
            kept = self._extend(inst, [f.seq for f in live], target, pairs)
            steps += 1
            if nodes is None:
                break
            live = [_Live(seq, live[pairs[i] // self.vocab].beam, nodes[i]) for seq, i in zip(inst.state.beams, kept)]
        return steps

    @staticmethod
    def _drafted(forest: _Forest, depths: list[int], live: list[_Live], depth: int) -> list[tuple[int, int, int]]:
        """``(node, slot, token)`` of the depth's drafted pairs below live beams, in draw order:
        the others' pairs dropped, these are still i.i.d. draws from the draft's joint over them."""
        slot = {(-1 - f.beam if f.node is None else f.node): i for i, f in enumerate(live)}
        return [
            (n, slot[parent], token)
            for n, (parent, token) in enumerate(zip(forest.parents, forest.tokens))
            if depths[n] == depth and parent in slot
        ]

    def _check_depth(
        self,
        inst: PromptSampling,
        forest: _Forest,
        num_beams: int,
        live: list[_Live],
        joint: torch.Tensor,
        drafted: list[tuple[int, int, int]],
        params: BeamSamplingParams,
        depth: int,
    ) -> tuple[list[int], list[int] | None]:
        """The depth's ``W`` pairs, and their draft nodes when all ``W`` were accepted drafts
        (``None``: the depth failed, the round ends)."""
        draft_rows = forest.rows.dense([f.beam if f.node is None else num_beams + f.node for f in live], self.vocab)
        draft_scores = [f.seq.cum_logprob if f.node is None else forest.scores[f.node] for f in live]
        draft = law_maths.beam_joint(torch.tensor(draft_scores, dtype=torch.float64), draft_rows, params.law)
        # the step on the pairs either joint gives (cut rows keep a few of 150k tokens): the same law
        support = torch.nonzero((joint > 0) | (draft > 0))[:, 0]  # [S], ascending flat pairs
        pairs = torch.searchsorted(support, torch.tensor([s * self.vocab + t for _, s, t in drafted]))  # [D]
        uniforms = torch.rand(len(drafted), generator=inst.generator, dtype=torch.float64)
        outcome = law_maths.speculative_depth(joint[support], draft[support], pairs, uniforms, params.beam_width)
        accepted = self.sampling_stats.accepted_per_depth
        accepted += [0] * (depth + 1 - len(accepted))
        accepted[depth] += len(outcome.accepted)
        if not outcome.succeeded:
            return support[law_maths.complete_depth(outcome, inst.generator)].tolist(), None
        return support[outcome.accepted].tolist(), [drafted[j][0] for j in outcome.outcome.accepted]
