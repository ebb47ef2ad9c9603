"""``vllm-specbeam mcsd train``: a stop model for one target/draft pair.

The pair runs in a vLLM engine with ``mcsd`` drafting plain chains to the
full depth (``k_config: [1]``, no stopping) and ``collect`` on, greedily, on
the given prompts; ``collect`` installs a :class:`StopDataCollector` as the drafter's
observer (:class:`~vllm_specbeam.methods.mcsd.drafter.ScoreObserver`), which records
every draft row the drafter scores and labels it by whether the target committed the
draft's top token there. So the stop model learns from the very features, draft and
runtime it will serve with. Training and the file format:
:mod:`vllm_specbeam.methods.mcsd.stopping`.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vllm_specbeam.core.drafter import DraftRequest, TreeDrafter
from vllm_specbeam.methods.mcsd import stopping
from vllm_specbeam.methods.mcsd.drafter import McsdDrafter, ScoredRows

#: the collected rows, saved next to the model (``--from-data`` retrains from them)
DATA_FILE = "stop_data.npz"

#: The collecting engine's KV cache unless ``--engine-args`` sizes it: a few short answers at a time
#: need little, while vLLM 0.32's CPU worker otherwise reserves 92% of the machine's memory and
#: refuses to start when slightly less is free (v1/worker/cpu_worker.py, ``CPUWorker.__init__``).
COLLECT_KV_CACHE_BYTES = 2 << 30


@dataclass
class StopData:
    """Scored ``q`` rows with their labels, for training a stop model."""

    features: np.ndarray  # [n, stopping.NUM_FEATURES]
    labels: np.ndarray  # [n]: 1.0 when the target committed the row's top token
    depths: np.ndarray  # [n]: the depth of the token drawn from the row (1 = below the root)


@dataclass
class PendingRows:
    """A request's ``q`` rows scored this step, labelled at its next step."""

    length: int  # committed tokens when drafted
    paths: list[tuple[int, ...]]  # the tokens from the root to each row's node
    top: list[int]  # each row's most likely token
    features: torch.Tensor  # [rows, stopping.NUM_FEATURES]


class StopDataCollector:
    """An ``mcsd`` drafter's observer that labels each scored row at the request's next step:
    1 when the target committed the row's top token, 0 otherwise; rows off the committed
    path are dropped (their children were never tested)."""

    def __init__(self) -> None:
        #: per request: the rows scored at its last step, not labelled yet
        self.pending: dict[str, PendingRows] = {}
        self.collected: list[StopData] = []

    def scored(self, rows: Sequence[ScoredRows]) -> None:
        for scored in rows:
            top = scored.logits.argmax(dim=-1).tolist()
            if scored.length is not None:
                self.pending[scored.req_id] = PendingRows(scored.length, list(scored.paths), top, scored.features)
            elif scored.req_id in self.pending:
                pending = self.pending[scored.req_id]
                pending.paths += scored.paths
                pending.top += top
                pending.features = torch.cat([pending.features, scored.features])

    def proposing(self, requests: Sequence[DraftRequest]) -> None:
        """Label last step's rows of these requests from the tokens committed since."""
        for request in requests:
            pending = self.pending.pop(request.req_id, None)
            if pending is None:
                continue
            committed = tuple(int(t) for t in request.token_ids[pending.length :])
            keep = [
                i
                for i, path in enumerate(pending.paths)
                if len(committed) > len(path) and committed[: len(path)] == path
            ]
            if keep:
                self.collected.append(
                    StopData(
                        pending.features[keep].numpy(),
                        np.asarray([committed[len(pending.paths[i])] == pending.top[i] for i in keep], np.float32),
                        np.asarray([len(pending.paths[i]) + 1 for i in keep], np.int64),
                    )
                )

    def removed(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self.pending.pop(req_id, None)

    def take(self) -> StopData:
        """The labelled rows collected so far (and forget them)."""
        data, self.collected = self.collected, []
        return StopData(
            np.concatenate([d.features for d in data]) if data else np.zeros((0, stopping.NUM_FEATURES), np.float32),
            np.concatenate([d.labels for d in data]) if data else np.zeros(0, np.float32),
            np.concatenate([d.depths for d in data]) if data else np.zeros(0, np.int64),
        )


def install_collector(drafter: TreeDrafter) -> StopDataCollector:
    """Collect ``drafter``'s scored rows from now on (the runner's drafter, with ``"collect": true``)."""
    if not isinstance(drafter, McsdDrafter):
        raise TypeError(f"collect: only mcsd's drafter scores rows for a stop model, not {type(drafter).__name__}")
    collector = drafter.observer = StopDataCollector()
    return collector


def take_stop_data(drafter: TreeDrafter) -> dict[str, list]:
    """The rows ``drafter``'s collector labelled so far, as plain lists (the worker's RPC's answer)."""
    collector = getattr(drafter, "observer", None)
    if not isinstance(collector, StopDataCollector):
        raise RuntimeError('no stop data was collected: start the mcsd engine with "collect": true')
    data = collector.take()
    return {"features": data.features.tolist(), "labels": data.labels.tolist(), "depths": data.depths.tolist()}


def engine_kwargs(engine_args: str) -> dict:
    """``--engine-args`` as ``LLM(...)`` keywords, the KV cache sized unless they size it."""
    try:
        kwargs = json.loads(engine_args)
    except json.JSONDecodeError as error:
        example = '{"max_model_len": 2048}'
        raise SystemExit(f"--engine-args is not JSON ({error}); pass an object, e.g. '{example}'") from error
    if not isinstance(kwargs, dict):
        raise SystemExit(f"--engine-args must be a JSON object of LLM(...) arguments, got {engine_args!r}")
    if not {"kv_cache_memory_bytes", "gpu_memory_utilization"} & kwargs.keys():
        kwargs["kv_cache_memory_bytes"] = COLLECT_KV_CACHE_BYTES
    return kwargs


def read_prompts(path: Path, skip: int, limit: int) -> list[str]:
    """Prompts from a JSONL file (``.gz`` too) with a ``prompt`` field per line, or a text file (one per line)."""
    if not path.is_file():
        raise SystemExit(f"--prompts {path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as file:
        lines = [line for line in file if line.strip()]
    if ".jsonl" in path.suffixes:
        records = [json.loads(line) for line in lines]
        bad = [i + 1 for i, r in enumerate(records) if not isinstance(r.get("prompt"), str)]
        if bad:
            raise SystemExit(f"--prompts {path}: lines {bad[:5]} have no string 'prompt' field")
        prompts = [r["prompt"] for r in records]
    else:
        prompts = [line.rstrip("\n") for line in lines]
    prompts = prompts[skip:][: limit or None]
    if not prompts:
        raise SystemExit(f"--prompts {path}: no prompts left after --skip {skip} --limit {limit}")
    return prompts


def collect(args: argparse.Namespace) -> dict[str, np.ndarray]:
    from vllm import LLM, SamplingParams

    spec = {
        "method": "mcsd",
        "model": args.draft,
        "k_config": [1],
        "num_speculative_tokens": args.depth,
        "max_nodes": args.depth,
        "stop_threshold": 0.0,
        "collect": True,
        "lookup": "off",  # the draft every step, its whole chain: no lookup branch takes its place
        **({"draft_vocab": args.draft_vocab} if args.draft_vocab else {}),
    }
    llm = LLM(
        model=args.target, speculative_config=spec, dtype=args.dtype, seed=args.seed, **engine_kwargs(args.engine_args)
    )
    prompts = read_prompts(Path(args.prompts), args.skip, args.limit)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    data = {k: np.asarray(v) for k, v in llm.collective_rpc("specbeam_take_stop_data")[0].items()}
    llm.llm_engine.engine_core.shutdown()
    return data


def arg_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    parser = argparse.ArgumentParser(
        prog="vllm-specbeam mcsd train",
        description="Train mcsd's stop model for one target/draft pair; pass the output directory as "
        '"stop_model" in the speculative config.',
    )
    parser.add_argument("--target", required=True, help="target model (name or path), as served")
    parser.add_argument("--draft", required=True, help="draft model (name or path), as served")
    parser.add_argument("--prompts", help="JSONL (.gz) with a 'prompt' field per line, or one per line")
    parser.add_argument("--out", required=True, help="directory to write stop_model.json to")
    parser.add_argument("--skip", type=int, default=0, help="skip the file's first prompts")
    parser.add_argument("--limit", type=int, default=0, help="use at most this many prompts (0: all)")
    parser.add_argument("--depth", type=int, default=6, help="draft depth while collecting")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument(
        "--from-data",
        default=None,
        help=f"train on the rows an earlier run saved (DIR/{DATA_FILE}) instead of collecting (no engine)",
    )
    parser.add_argument(
        "--draft-vocab", default=None, help="the draft vocabulary the stop model will serve with (draft_vocab)"
    )
    parser.add_argument("--dtype", default="auto", help="the engine's dtype, as served")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-args",
        default="{}",
        help="more LLM(...) arguments as JSON, e.g. '{\"max_model_len\": 2048}' (the KV cache is "
        f"{COLLECT_KV_CACHE_BYTES >> 30} GiB unless they set kv_cache_memory_bytes or gpu_memory_utilization)",
    )
    return parser


def main(argv: list[str]) -> int:
    parser = arg_parser()
    args = parser.parse_args(argv)
    if not args.prompts and not args.from_data:
        parser.error("give --prompts to collect on (or --from-data to retrain from saved rows)")

    if args.from_data:
        with np.load(args.from_data) as saved:
            data = dict(saved)
    else:
        data = collect(args)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        np.savez_compressed(Path(args.out) / DATA_FILE, **data)
    depths = data["depths"]
    print(f"collected {len(depths)} draft rows from {args.target} / {args.draft}")
    for depth in np.unique(depths):
        labels = data["labels"][depths == depth]
        print(f"  depth {depth}: {len(labels)} rows, target agreed with the draft's top token on {labels.mean():.1%}")
    model, report = stopping.train_stop_model(data["features"], data["labels"], epochs=args.epochs, seed=args.seed)
    path = stopping.save_stop_model(args.out, model, stopping.PairIdentity.of(args.target, args.draft), report)
    print(
        f"held-out accuracy {report.heldout_accuracy:.3f} on {report.heldout_rows} rows "
        f"(always guessing the majority: {max(report.positive_rate, 1 - report.positive_rate):.3f}), "
        f"log-loss {report.heldout_log_loss:.3f} (a constant: {report.constant_log_loss:.3f}); "
        f"wrote {path} ({path.stat().st_size} bytes)"
    )
    return 0
