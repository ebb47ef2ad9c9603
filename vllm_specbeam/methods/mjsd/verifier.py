"""MJSD verification: the joint-likelihood rule for joint drafts, exact rules for the rest.

A :class:`~vllm_specbeam.methods.mjsd.maths.JointDraft` is verified by the
joint rule (:func:`~vllm_specbeam.methods.mjsd.maths.joint_choice`; **lossy by
design**: the output is not the target's own decoding). ``p`` is what the
runner hands the rule: at temperature 0 the target's raw logits, whose
softmax (temperature 1) gives ``log P``, and the committed token is the argmax
at the accepted node; when sampling, the request's sampling distribution
(temperature, top-k, top-p applied), and the committed token is drawn from it
at the accepted node (one uniform per request, from its own generator).

Any other draft comes from ``"verify": "block"`` (or is an empty draft) and
gets the exact rules: greedy tree matching at temperature 0, block
verification of the sampled chain otherwise (exact target sampling).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_specbeam.core.tree import ROOT, DraftTree
from vllm_specbeam.core.verifiers.base import TreeVerifier, Verdict
from vllm_specbeam.core.verifiers.block import BlockVerifier
from vllm_specbeam.core.verifiers.greedy import GreedyTreeVerifier
from vllm_specbeam.core.verifiers.residual import FlatNodes, draw_uniforms, sample_rows, working_precision
from vllm_specbeam.methods.mjsd.maths import JointDraft, joint_choice


class MjsdVerifier(TreeVerifier):
    """Joint drafts by the joint rule, the others exactly (see the module docstring)."""

    def __init__(self, greedy: bool = False) -> None:
        self.greedy = greedy
        self.exact: TreeVerifier = GreedyTreeVerifier() if greedy else BlockVerifier()

    def verify(
        self,
        trees: Sequence[DraftTree],
        target: torch.Tensor,
        row_starts: np.ndarray,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> Verdict:
        gens = list(generators) if generators is not None else [None] * len(trees)
        joint = [k for k, tree in enumerate(trees) if isinstance(tree, JointDraft)]
        exact = [k for k, tree in enumerate(trees) if not isinstance(tree, JointDraft)]
        accepted: list[np.ndarray] = [np.zeros(0, np.int64)] * len(trees)
        tokens: list[list[int]] = [[]] * len(trees)
        off_argmax = [0] * len(trees)
        starts = np.asarray(row_starts, np.int64)
        if exact:
            verdict = self.exact.verify([trees[k] for k in exact], target, starts[exact], [gens[k] for k in exact])
            for k, path, committed in zip(exact, verdict.accepted, verdict.tokens):
                accepted[k], tokens[k] = path, committed
        if joint:
            drafts = [trees[k] for k in joint]
            assert all(isinstance(d, JointDraft) for d in drafts)
            verdict = self._joint(drafts, target, starts[joint], [gens[k] for k in joint])  # type: ignore[arg-type]
            for k, path, committed, off in zip(joint, verdict.accepted, verdict.tokens, verdict.off_argmax or ()):
                accepted[k], tokens[k], off_argmax[k] = path, committed, off
        return Verdict(accepted, tokens, off_argmax=off_argmax)

    def _joint(
        self,
        trees: Sequence[JointDraft],
        target: torch.Tensor,
        row_starts: np.ndarray,
        generators: Sequence[torch.Generator | None],
    ) -> Verdict:
        nodes = FlatNodes.of(trees, row_starts)
        device = target.device
        parent_rows = working_precision(target[torch.from_numpy(nodes.parent_rows).to(device)])  # [N, V]
        chosen = torch.from_numpy(nodes.tokens).to(device).unsqueeze(-1)  # [N, 1]
        if self.greedy:
            token_logp = torch.log_softmax(parent_rows, dim=-1).gather(-1, chosen).squeeze(-1)  # [N]
        else:
            token_logp = parent_rows.gather(-1, chosen).squeeze(-1).log()  # [N]
        is_argmax = parent_rows.argmax(dim=-1) == chosen.squeeze(-1)  # [N]
        host = torch.stack([token_logp.double(), is_argmax.double()]).cpu().numpy()  # one host sync
        token_logp_host, is_argmax_host = host[0], host[1].astype(bool)
        paths, last_rows, off_argmax = [], [], []
        for b, tree in enumerate(trees):
            span = slice(int(nodes.offsets[b]), int(nodes.offsets[b + 1]))
            node = joint_choice(tree, token_logp_host[span])
            path = np.asarray(tree.path_to(node), np.int64)
            paths.append(path)
            last_rows.append(int(row_starts[b]) + (0 if node == ROOT else node + 1))
            off_argmax.append(int((~is_argmax_host[span][path]).sum()))
        rows = target[torch.as_tensor(last_rows, device=device)]  # [B, V]
        if self.greedy:
            committed = rows.argmax(dim=-1).tolist()
        else:
            uniforms = draw_uniforms([1] * len(trees), generators, device)
            committed = sample_rows(working_precision(rows), torch.cat(uniforms)).tolist()
        tokens = [[*tree.tokens[path].tolist(), token] for tree, path, token in zip(trees, paths, committed)]
        return Verdict(paths, tokens, off_argmax=off_argmax)


class MjsdGreedyVerifier(MjsdVerifier):
    """MJSD at temperature 0: the joint rule on the target's logits; exact greedy matching for block drafts."""

    def __init__(self) -> None:
        super().__init__(greedy=True)
