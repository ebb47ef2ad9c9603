"""``vllm-specbeam mcsd train``: a stop model for one target/draft pair.

The pair runs in a vLLM engine with ``mcsd`` drafting plain chains to the
full depth (``k_config: [1]``, no stopping) and ``collect`` on, greedily, on
the given prompts; the drafter records every draft row it scores and labels
it by whether the target committed the draft's top token there (see
:mod:`vllm_specbeam.methods.mcsd.drafter`). So the stop model learns from the
very features, draft and runtime it will serve with. Training and the file
format: :mod:`vllm_specbeam.methods.mcsd.stopping`.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np

from vllm_specbeam.methods.mcsd import stopping

#: the collected rows, saved next to the model (``--from-data`` retrains from them)
DATA_FILE = "stop_data.npz"

#: The collecting engine's KV cache unless ``--engine-args`` sizes it: a few short answers at a time
#: need little, while vLLM 0.32's CPU worker otherwise reserves 92% of the machine's memory and
#: refuses to start when slightly less is free (v1/worker/cpu_worker.py, ``CPUWorker.__init__``).
COLLECT_KV_CACHE_BYTES = 2 << 30


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


def main(argv: list[str]) -> int:
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
