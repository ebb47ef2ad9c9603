"""Load, faults and bad input against ``vllm-specbeam serve``: exact under load.

A wave of mixed requests (completions and chat, streamed and not, logprobs,
stop strings, EOS allowed, different ``max_tokens``, per-request
``vllm_xargs``, and seeded sampled requests with ``n=2``) goes at once, with
the official ``openai`` client, to a server without speculation and to one
server per plugin method: every greedy answer must be identical. Each plugin
server then gets the faults (streams dropped after a few chunks, requests
abandoned by their clients) and bad requests (each must fail alone, with a
4xx naming its problem) beside another wave that must still be exact; after
every wave the server must be idle with its KV cache empty and its drafter
and draft runtime holding no request (read through vLLM's dev-mode
``/collective_rpc``). ``--waves N`` repeats the wave and reports the server's
memory after each, per process (API server, engine core, worker): it must stay
flat. Method ``none`` runs the same waves, faults and vLLM's own bad inputs on
the server without speculation (its first wave is the reference): what vLLM
itself does under these waves, its memory and liveness, and how often its own
later greedy answers differ from its first (the batch around a request changes
the rounding of a bfloat16 engine: the rate the plugin's is held to).
``--turns N`` then times the servers in turns, to tell a few per cent apart on
a machine whose speed drifts by more between runs: each turn starts every
server anew (``none`` and the methods, the order rotated each turn), sends
one untimed wave and ``--turn-waves`` timed ones, and each method's wave time is
put against ``none``'s of the same turn.
``tests/test_server.py`` runs the same code (``benchmarks/load.py``) on the tiny
test model.

    python benchmarks/load_test.py                             # SmolLM2-135M, lookup_tree and aded, 200 requests
    python benchmarks/load_test.py --methods lookup_tree+global --requests 200 --waves 5
    python benchmarks/load_test.py --methods none lookup_tree --waves 8   # memory: vLLM alone vs the plugin
    python benchmarks/load_test.py --methods lookup_tree aded --waves 1 --turns 3   # wall time, in turns

(``python -m benchmarks.load_test`` from the repository runs the same.)
Outputs ``OUT/load.json``, ``OUT/load.md`` and the servers' logs.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a file: import the package from the repository
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from benchmarks import models
from benchmarks.host import add_dtype_option, choose_dtype
from benchmarks.load import (
    Answer,
    Call,
    ServerReport,
    bad_requests,
    finishes,
    markdown,
    reference_answers,
    rss_table,
    run_plugin_server,
    speculative_config,
    timed_wave,
    workload,
)
from benchmarks.processes import ENV_DEFAULTS, Server, running_server
from benchmarks.prompts import load_prompts
from benchmarks.serve_client import served_model
from benchmarks.tables import markdown_table


@dataclass
class Turns:
    """Wave wall times of servers started in turns: ``seconds[name][turn]`` holds that turn's timed waves."""

    seconds: dict[str, list[list[float]]] = field(default_factory=dict)

    def ratios(self, name: str) -> list[float]:
        """``name``'s median wave against ``none``'s, turn by turn."""
        return [
            statistics.median(mine) / statistics.median(base)
            for mine, base in zip(self.seconds[name], self.seconds["none"])
        ]

    def markdown(self) -> str:
        rows = [
            {
                "method": name,
                "turns": "; ".join(", ".join(f"{s:.2f}" for s in waves) for waves in per_turn),
                "by_turn": "" if name == "none" else ", ".join(f"{r:.3f}" for r in self.ratios(name)),
                "median": None if name == "none" else statistics.median(self.ratios(name)),
            }
            for name, per_turn in self.seconds.items()
        ]
        columns = (
            ("method", "method", 0),
            ("wave s, turn by turn", "turns", 0),
            ("vs none, turn by turn", "by_turn", 0),
            ("vs none (median of turns)", "median", 3),
        )
        return markdown_table(rows, columns)


def timed_turns(
    model: str,
    names: Sequence[str],
    draft: str | None,
    calls: Sequence[Call],
    server_args: Sequence[str],
    args: argparse.Namespace,
    out: Path,
) -> Turns:
    """Every server of ``names`` (``none`` first) started anew in each of ``args.turns`` turns, in
    :func:`turn_order`: one untimed wave, then ``args.turn_waves`` timed ones."""
    turns = Turns({name: [] for name in names})
    for turn in range(args.turns):
        for name in turn_order(names, turn):
            config = speculative_config(name, draft)
            log = out / f"server-{name}-turn{turn + 1}.log"
            with running_server(model, config, log, *server_args) as server:
                timed = [timed_wave(server.url, calls, config is not None) for _ in range(1 + args.turn_waves)]
            failed = [a for _, answers in timed for a in answers if isinstance(a, BaseException)]
            if failed:
                raise RuntimeError(f"{name}, turn {turn + 1}: {len(failed)} requests failed: {failed[0]!r}")
            times = [seconds for seconds, _ in timed[1:]]  # the first wave warms the server up
            turns.seconds[name].append(times)
            print(f"turn {turn + 1}, {name}: waves {', '.join(f'{t:.2f}' for t in times)} s", flush=True)
    return turns


def turn_order(names: Sequence[str], turn: int) -> list[str]:
    """``names`` rotated by ``turn``, so that in ``len(names)`` turns every server runs once in every
    place of a turn (a machine that drifts within a turn favours no server). Example: ``a b c``,
    then ``b c a``, then ``c a b``."""
    shift = turn % len(names)
    return [*names[shift:], *names[:shift]]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from vllm_specbeam.core.config import parse

    for key, value in ENV_DEFAULTS.items():
        if key != "VLLM_CPU_KVCACHE_SPACE":  # the KV cache is sized by --kv-cache-memory-bytes
            os.environ.setdefault(key, value)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    model = models.resolve_option(args.model)
    draft = models.resolve_option(args.draft)
    assert model is not None
    dtype = choose_dtype(args.dtype)
    prompts = [p.text for p in load_prompts(args.prompts, args.num_prompts)]
    calls = workload(prompts, args.requests, stops=["\n\n", "return", ":"], xargs=args.xargs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server_args = ["--dtype", dtype.engine, "--max-model-len", str(args.max_model_len), "--seed", "0"]
    server_args += ["--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
    reports: list[ServerReport] = []
    all_problems: dict[str, list[str]] = {}

    def run(name: str, server: Server, reference: Sequence[Answer]) -> None:
        config = speculative_config(name, draft)
        engine_max_nodes = parse(config, model, model).max_nodes if config else 1
        report = ServerReport(name, config or {}, eos_finishes=eos, stop_finishes=stop)
        bad = bad_requests(served_model(server.url), engine_max_nodes, args.max_model_len, args.prompt_word)
        if config is None:  # vLLM's own checks only: no plugin to read vllm_xargs
            bad = [b for b in bad if "vllm_xargs" not in b.body]
        all_problems[name] = run_plugin_server(
            server.url, report, calls, reference, bad, prompts, args.waves, args.faults, server.pid, config is not None
        )
        reports.append(report)
        print(f"{name}: {len(all_problems[name])} problems", *all_problems[name][:10], sep="\n  ", flush=True)

    with running_server(model, None, out / "server-none.log", *server_args) as server:
        reference = reference_answers(server.url, calls)
        eos, stop = finishes(calls, reference)
        if "none" in args.methods:  # the same waves on this server, the reference wave first
            run("none", server, reference)
    for name in args.methods:
        if name != "none":
            with running_server(
                model, speculative_config(name, draft), out / f"server-{name}.log", *server_args
            ) as server:
                run(name, server, reference)
    names = ["none", *(name for name in args.methods if name != "none")]
    turns = timed_turns(model, names, draft, calls, server_args, args, out) if args.turns else None
    config = {**vars(args), "engine_dtype": dtype.engine, "dtype_fallback": dtype.fallback}
    write_outputs(out, config, reports, all_problems, turns)
    return 1 if any(all_problems.values()) else 0


def write_outputs(
    out: Path, config: dict, reports: Sequence[ServerReport], problems: dict[str, list[str]], turns: Turns | None
) -> None:
    """``load.json`` (everything measured) and ``load.md`` (the tables, also printed)."""
    record = {"config": config, "reports": [asdict(r) for r in reports], "problems": problems}
    (out / "load.json").write_text(json.dumps({**record, "turns": None if turns is None else turns.seconds}, indent=1))
    table = markdown(reports) + "\n" + rss_table(reports)
    if turns is not None:
        none = turns.seconds["none"]
        table += f"\nWall time in turns ({len(none)} turns, {len(none[0])} timed waves each):\n\n{turns.markdown()}"
    (out / "load.md").write_text(table)
    print(table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="target: path or hub name (default %(default)s)")
    parser.add_argument("--draft", default=None, help="draft model for dsbd, mcsd and mjsd")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["lookup_tree", "aded"],
        help="plugin methods; method+global for lookup_tree's global scope; none: the same waves "
        "on the server without speculation (memory, liveness, and its later waves against its first)",
    )
    parser.add_argument("--prompts", default="humaneval", help="humaneval | natural | path to JSONL with 'prompt'")
    parser.add_argument("--num-prompts", type=int, default=40, help="distinct prompts, cycled over the requests")
    parser.add_argument("--requests", type=int, default=200, help="requests per wave, all sent at once")
    parser.add_argument("--waves", type=int, default=2, help="waves per server (memory reported after each)")
    parser.add_argument("--faults", type=int, default=10, help="dropped streams and abandoned requests, each")
    parser.add_argument("--turns", type=int, default=0, help="then time the servers in this many turns (0: none)")
    parser.add_argument("--turn-waves", type=int, default=2, help="timed waves per server and turn")
    parser.add_argument(
        "--xargs",
        type=json.loads,
        default={"num_speculative_tokens": 2, "max_nodes": 4},
        help="per-request options sent with some calls (JSON)",
    )
    parser.add_argument(
        "--kv-cache-bytes", type=int, default=1 << 30, help="every server's KV cache in bytes: small enough to preempt"
    )
    parser.add_argument("--prompt-word", default=" return", help="text of one token, repeated for the too-long prompt")
    add_dtype_option(parser)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", default=f"results/load-{time.strftime('%Y%m%d-%H%M%S')}")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
