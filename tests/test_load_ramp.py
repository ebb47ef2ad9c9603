"""serve_bench.py's load ramp, from made-up level results (no server): each method's throughput
over no speculation's at the same level (by position: a ramp may come back to a concurrency,
and "1 after the load" must be compared with the baseline's last 1, not its first), the
runner counters' table with keys a runner may lack, and the plot; and the fresh start the
server gets before each level, from a fake HTTP client."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks import serve_bench, serve_client
from benchmarks.plan import EngineSpec
from benchmarks.serve_bench import Level, ServerRun
from benchmarks.serve_client import requests_per_level, runner_stats

CONCURRENCY = [1, 2, 4, 1]
#: output tokens/s per level; the baseline's two 1s differ, so the wrong one shows
THROUGHPUT = {"none": [10.0, 18.0, 30.0, 8.0], "lookup_tree": [15.0, 20.0, 27.0, 14.0]}


def level_row(method: str, index: int, concurrency: int, tokens_per_s: float) -> dict:
    return {"level": index, "concurrency": concurrency, "method": method, "output_tokens_per_s": tokens_per_s}


def runs(stats: dict | None) -> dict[str, ServerRun]:
    kinds = {"none": "baseline", "lookup_tree": "plugin"}
    return {
        method: ServerRun(
            method,
            kinds[method],
            None if method == "none" else {"method": method},
            levels=[level_row(method, i, c, t) for i, (c, t) in enumerate(zip(CONCURRENCY, values))],
            plugin_stats=stats if kinds[method] == "plugin" else None,
        )
        for method, values in THROUGHPUT.items()
    }


def table_cells(markdown: str, first_cell: str) -> list[str]:
    """The cells of the Markdown table row that starts with ``first_cell``."""
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {first_cell} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_ratios_are_per_level_position_and_the_plot_is_written(tmp_path):
    levels = serve_bench.ramp(CONCURRENCY)
    assert levels == [Level(0, 1), Level(1, 2), Level(2, 4), Level(3, 1)]
    servers = runs({"trees": 40, "accepted": 55, "steps_off": 3, "draft_cost_per_row_s": 2.5e-5})
    expected = [t / n for t, n in zip(THROUGHPUT["lookup_tree"], THROUGHPUT["none"])]
    assert expected[3] != pytest.approx(THROUGHPUT["lookup_tree"][3] / THROUGHPUT["none"][0])  # the test can tell

    relative = serve_bench.relative_throughput(servers, levels)
    assert list(relative) == ["lookup_tree"]
    assert relative["lookup_tree"] == pytest.approx(expected)

    serve_bench.add_speedups(servers)
    assert [row["speedup"] for row in servers["lookup_tree"].levels] == pytest.approx(expected)
    assert [row["speedup"] for row in servers["none"].levels] == pytest.approx([1.0] * 4)

    markdown = serve_bench.ramp_markdown(servers, levels, relative)
    assert table_cells(markdown, "method")[1:] == ["L0 c=1", "L1 c=2", "L2 c=4", "L3 c=1"]
    assert table_cells(markdown, "lookup_tree")[1:5] == [f"{r:.2f}" for r in expected]
    # the runner's table: reported keys scaled, the others (steps_probed, step cost) a dash
    counters = markdown[markdown.index("Plugin runner counters") :]
    assert table_cells(counters, "lookup_tree")[1:] == ["40", "55", "3", "–", "25.0", "–"]

    ramp = serve_bench.ramp_json(levels, relative, requests=4)
    assert json.loads(json.dumps(ramp))["throughput_vs_none"]["lookup_tree"]["L3 c=1"] == pytest.approx(expected[3])

    path = tmp_path / serve_bench.RAMP_PNG
    serve_bench.plot_ramp(servers, levels, path, "tiny: 4 requests per level")
    assert path.stat().st_size > 0


def test_missing_baseline_levels_and_runner_counters_show_as_dashes(tmp_path):
    levels = serve_bench.ramp(CONCURRENCY)
    servers = runs(None)  # the runner did not answer
    servers["none"].levels = servers["none"].levels[:2]  # the baseline stopped after two levels
    servers["failed"] = ServerRun("mcsd", "plugin", {"method": "mcsd"}, status="failed", reason="start-up")
    relative = serve_bench.relative_throughput(servers, levels)
    assert relative["lookup_tree"][2:] == [None, None] and relative["failed"] == [None] * 4

    markdown = serve_bench.ramp_markdown(servers, levels, relative)
    assert table_cells(markdown, "failed")[1:] == ["–"] * 4
    counters = markdown[markdown.index("Plugin runner counters") :]
    assert table_cells(counters, "lookup_tree")[1:] == ["–"] * len(serve_bench.STAT_COLUMNS)
    serve_bench.plot_ramp(servers, levels, tmp_path / "partial.png", "partial")  # gaps, a server without levels
    assert (tmp_path / "partial.png").stat().st_size > 0


def test_every_level_sends_the_same_requests():
    args = serve_bench.parse_args(["--concurrency", "1", "2", "4", "8", "16", "1", "--num-requests", "4"])
    assert args.concurrency == [1, 2, 4, 8, 16, 1]
    assert requests_per_level(args) == 16  # the highest concurrency, at every level
    assert requests_per_level(serve_bench.parse_args(["--concurrency", "1", "2"])) == 16  # --num-requests
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--concurrency", "1", "0"])


def test_runner_counters_of_a_server_that_does_not_answer_are_none(capsys):
    assert runner_stats("http://127.0.0.1:9") is None  # nothing listens on the discard port
    assert "no runner counters" in capsys.readouterr().out


class FakeResponse:
    def __init__(self, body: dict | None) -> None:
        self.body = body

    def raise_for_status(self) -> None:
        pass

    def json(self) -> dict:
        assert self.body is not None, "this endpoint answers no JSON"
        return self.body


class FakeClient:
    """Records the POSTs (``httpx.AsyncClient.post``) into ``calls``; ``/reset_prefix_cache``
    answers ``{"success": resets.pop(0)}``."""

    def __init__(self, calls: list, resets: list[bool]) -> None:
        self.calls, self.resets = calls, resets

    async def post(self, path: str, json: dict | None = None) -> FakeResponse:
        self.calls.append(("post", path, json))
        return FakeResponse({"success": self.resets.pop(0)} if path == "/reset_prefix_cache" else None)


def fake_ramp(monkeypatch, kind: str, method: str, resets: list[bool]) -> tuple[list, list]:
    """serve_client.run_ramp over :class:`FakeClient`, its requests and levels recorded in the
    same list: (the calls in order, the levels' figures)."""
    calls: list = []

    async def one_request(client, model, prompt, args):
        calls.append(("warm-up", prompt))

    async def load_level(client, model, prompts, concurrency, args):
        calls.append(("level", concurrency))
        return {"concurrency": concurrency}

    monkeypatch.setattr(serve_client, "one_request", one_request)
    monkeypatch.setattr(serve_client, "load_level", load_level)
    engine = EngineSpec(method, method, kind, None if kind == "baseline" else {"method": method}, [])
    args = serve_bench.parse_args(["--concurrency", *map(str, CONCURRENCY)])
    levels = asyncio.run(serve_client.run_ramp(FakeClient(calls, resets), engine, "m", ["p0", "p1"], args))
    return calls, levels


RESET = ("post", "/reset_prefix_cache", None)
FORGET = ("post", "/collective_rpc", {"method": "specbeam_forget_finished"})


def test_a_plugin_server_forgets_and_empties_its_prefix_cache_before_every_level(monkeypatch):
    calls, levels = fake_ramp(monkeypatch, "plugin", "lookup_tree", [True] * len(CONCURRENCY))
    expected = [("warm-up", "p0")]
    for c in CONCURRENCY:  # the warm-up's and each earlier level's memory and KV blocks gone
        expected += [FORGET, RESET, ("level", c)]
    assert calls == expected
    assert levels == [{"concurrency": c, "level": i, "method": "lookup_tree"} for i, c in enumerate(CONCURRENCY)]


def test_a_baseline_server_only_empties_its_prefix_cache(monkeypatch):
    calls, _ = fake_ramp(monkeypatch, "baseline", "none", [True] * len(CONCURRENCY))
    assert calls == [("warm-up", "p0"), *(step for c in CONCURRENCY for step in (RESET, ("level", c)))]


def test_a_prefix_cache_that_was_not_emptied_stops_the_ramp(monkeypatch):
    with pytest.raises(RuntimeError, match=r"server suffix did not empty its prefix cache before level 2"):
        fake_ramp(monkeypatch, "vllm", "suffix", [True, True, False, True])


def test_suffix_is_marked_as_keeping_what_earlier_levels_taught_it():
    levels = serve_bench.ramp(CONCURRENCY)
    servers = runs(None)
    assert "not emptied between levels" not in serve_bench.ramp_markdown(servers, levels, {})
    servers["suffix"] = ServerRun("suffix", "vllm", {"method": "suffix"})
    markdown = serve_bench.ramp_markdown(servers, levels, serve_bench.relative_throughput(servers, levels))
    ratios = markdown[markdown.index("Output tokens/s over") : markdown.index("Plugin runner counters")]
    assert "`suffix`: its cache of responses is not emptied between levels" in ratios
    assert "later levels are favoured" in serve_bench.__doc__.replace("\n", " ")
