"""The load test's library: its workload and answers, faults and bad input,
one server's whole run, and the tables of ``load.md``.

``load_test.py`` runs it against a server per method; ``tests/test_server.py``
on the tiny test model. No vLLM import: the servers run in their own processes.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import requests

from benchmarks.serve_client import prometheus, served_model
from benchmarks.tables import markdown_table

#: A float32 greedy answer's logprobs may differ in the last bits between batch compositions; tokens
#: may not. (bfloat16's differ by more, and are reported: ``ServerReport.logprob_gap``.)
LOGPROB_TOLERANCE = 1e-3
#: Chunks a dropped stream reads before its client hangs up.
CHUNKS_BEFORE_DISCONNECT = 2


# ------------------------------------------------------------------ servers
def plugin_stats(url: str) -> dict[str, float]:
    """The tree runner's counters and live state (``TreeCPUWorker.specbeam_stats``), first worker."""
    response = requests.post(f"{url}/collective_rpc", json={"method": "specbeam_stats"}, timeout=60)
    response.raise_for_status()
    return response.json()["results"][0]


def wait_idle(url: str, timeout: float = 120.0) -> dict[str, float]:
    """Wait until no request runs or waits and the KV cache is empty (aborts
    reach the engine a moment after their clients leave); returns the figures."""
    deadline = time.monotonic() + timeout
    while True:
        figures = {
            "running": prometheus(url, "vllm:num_requests_running"),
            "waiting": prometheus(url, "vllm:num_requests_waiting"),
            "kv_cache_usage": prometheus(url, "vllm:kv_cache_usage_perc"),
        }
        if not any(figures.values()) or time.monotonic() > deadline:
            return figures
        time.sleep(1.0)


def process_rss_mib(pid: int) -> dict[str, float]:
    """RSS in MiB of the server and each of its descendants (vLLM names its
    processes ``VLLM::EngineCore``, ``VLLM::Worker...``), keyed ``name pid``;
    the API server is ``APIServer pid``, multiprocessing's helper
    ``resource_tracker pid``. Processes that exit meanwhile are left out."""
    import psutil

    root = psutil.Process(pid)
    figures = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            name = "APIServer" if process.pid == pid else process.name()
            if "resource_tracker" in " ".join(process.cmdline()):
                name = "resource_tracker"
            figures[f"{name} {process.pid}"] = process.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return figures


# ----------------------------------------------------------------- workload
@dataclass(frozen=True)
class Call:
    """One request of the workload, as the client sends it."""

    chat: bool
    stream: bool
    prompt: str
    max_tokens: int
    logprobs: bool
    stop: tuple[str, ...]
    #: per-request plugin options (``vllm_xargs``); only sent to plugin servers
    xargs: dict[str, Any] | None
    #: sampled (temperature 0.8, ``n=2``) with this seed; greedy when None
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.seed is None


@dataclass(frozen=True)
class Answer:
    """What came back: one text and finish reason per choice, and the chosen
    tokens' logprobs of the first choice (empty without ``logprobs``)."""

    texts: tuple[str, ...]
    finish_reasons: tuple[str | None, ...]
    logprobs: tuple[float, ...] = ()

    def same_tokens_as(self, other: Answer) -> bool:
        """Identical tokens (texts) and finish reasons: what exactness promises."""
        return self.texts == other.texts and self.finish_reasons == other.finish_reasons

    def logprob_gap(self, other: Answer) -> float:
        """The widest difference of the chosen tokens' logprobs (of answers with the same tokens):
        rounding, which in bfloat16 moves with the batch around a request."""
        if len(self.logprobs) != len(other.logprobs):
            return math.inf
        return max((abs(a - b) for a, b in zip(self.logprobs, other.logprobs)), default=0.0)


def workload(
    prompts: Sequence[str], count: int, stops: Sequence[str], xargs: dict[str, Any], seed: int = 0
) -> list[Call]:
    """``count`` calls cycling through the prompts: chat or completion, streamed or not,
    with logprobs, a stop string, lowered plugin options, or sampled with ``n=2``, mixed."""
    rng = random.Random(seed)
    calls = []
    for index in range(count):
        calls.append(
            Call(
                chat=index % 4 >= 2,
                stream=index % 2 == 1,
                prompt=prompts[index % len(prompts)],
                max_tokens=rng.choice([8, 16, 24, 32, 48]),
                logprobs=index % 3 == 0,
                stop=(rng.choice(stops),) if index % 5 == 1 else (),
                xargs=dict(xargs) if index % 7 == 3 else None,
                seed=index if index % 10 == 9 else None,
            )
        )
    return calls


def _body(call: Call, model: str, plugin: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": call.max_tokens,
        "temperature": 0.0 if call.greedy else 0.8,
        "stream": call.stream,
        "extra_body": {"ignore_eos": False, **({"vllm_xargs": call.xargs} if plugin and call.xargs else {})},
    }
    if call.stop:
        body["stop"] = list(call.stop)
    if not call.greedy:
        body.update(n=2, seed=call.seed)
    if call.chat:
        body["messages"] = [{"role": "user", "content": call.prompt}]
        if call.logprobs:
            body.update(logprobs=True, top_logprobs=2)
    else:
        body["prompt"] = call.prompt
        if call.logprobs:
            body["logprobs"] = 2
    return body


async def send(client: Any, model: str, call: Call, plugin: bool) -> Answer:
    """One call through the openai client, streamed chunks joined per choice."""
    body = _body(call, model, plugin)
    endpoint = client.chat.completions if call.chat else client.completions
    response = await endpoint.create(**body)
    chunks = [chunk async for chunk in response] if call.stream else [response]
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    logprobs: list[float] = []
    for chunk in chunks:
        for choice in chunk.choices:
            text = (choice.delta.content if call.stream else choice.message.content) if call.chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (text or "")
            if choice.finish_reason is not None or choice.index not in reasons:
                reasons[choice.index] = choice.finish_reason
            if choice.index == 0 and choice.logprobs is not None:
                if call.chat:
                    logprobs += [entry.logprob for entry in choice.logprobs.content or []]
                else:
                    logprobs += list(choice.logprobs.token_logprobs or [])
    order = sorted(texts)
    return Answer(tuple(texts[i] for i in order), tuple(reasons[i] for i in order), tuple(logprobs))


def client_for(url: str, timeout: float = 600.0) -> Any:
    from openai import AsyncOpenAI

    # No retries: a failed request must show as a failure, not be sent again.
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=timeout, max_retries=0)


async def wave(url: str, calls: Sequence[Call], plugin: bool) -> list[Answer | BaseException]:
    """Every call at once; an exception in place of each failed one."""
    client = client_for(url)
    model = served_model(url)
    try:
        return await asyncio.gather(*(send(client, model, call, plugin) for call in calls), return_exceptions=True)
    finally:
        await client.close()


def timed_wave(url: str, calls: Sequence[Call], plugin: bool) -> tuple[float, list[Answer | BaseException]]:
    """One :func:`wave` and its wall seconds."""
    start = time.perf_counter()
    answers = asyncio.run(wave(url, calls, plugin=plugin))
    return time.perf_counter() - start, answers


# ------------------------------------------------------------------- faults
@dataclass
class Faults:
    """Requests whose clients left early: how many, and that they did."""

    dropped_streams: int = 0
    abandoned: int = 0


async def drop_streams(url: str, prompts: Sequence[str], count: int) -> int:
    """Streams closed by their clients after a few chunks (long ``max_tokens``, EOS ignored)."""
    client = client_for(url)
    model = served_model(url)

    async def one(prompt: str) -> int:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=200, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
        )
        read = 0
        async for _ in stream:
            read += 1
            if read == CHUNKS_BEFORE_DISCONNECT:
                break
        await stream.close()
        return int(read == CHUNKS_BEFORE_DISCONNECT)

    try:
        return sum(await asyncio.gather(*(one(prompts[i % len(prompts)]) for i in range(count))))
    finally:
        await client.close()


async def abandon_requests(url: str, prompts: Sequence[str], count: int, after_seconds: float = 0.5) -> int:
    """Non-streamed requests whose clients time out and hang up before the answer."""
    from openai import APITimeoutError

    client = client_for(url, timeout=after_seconds)
    model = served_model(url)

    async def one(prompt: str) -> int:
        try:
            await client.completions.create(
                model=model, prompt=prompt, max_tokens=400, temperature=0.0, extra_body={"ignore_eos": True}
            )
        except APITimeoutError:
            return 1
        return 0

    try:
        return sum(await asyncio.gather(*(one(prompts[i % len(prompts)]) for i in range(count))))
    finally:
        await client.close()


# ---------------------------------------------------------------- bad input
@dataclass(frozen=True)
class BadRequest:
    """A request that must fail alone, with a 4xx whose message contains ``expect``."""

    name: str
    body: dict[str, Any]
    expect: str


def bad_requests(model: str, engine_max_nodes: int, max_model_len: int, prompt_word: str) -> list[BadRequest]:
    """One of each kind of bad input; ``prompt_word`` is a word the tokenizer reads as one token."""
    base = {"model": model, "prompt": prompt_word, "max_tokens": 4, "temperature": 0.0}
    too_many_nodes = min(engine_max_nodes + 1, 128)
    return [
        BadRequest("vllm_xargs not an object", {**base, "vllm_xargs": "max_nodes=4"}, "vllm_xargs"),
        BadRequest("option of the wrong type", {**base, "vllm_xargs": {"max_nodes": "four"}}, "must be an int"),
        BadRequest("option out of range", {**base, "vllm_xargs": {"num_speculative_tokens": 0}}, "must be in [1, 32]"),
        BadRequest(
            "option above the engine's",
            {**base, "vllm_xargs": {"max_nodes": too_many_nodes}},
            f"max_nodes={too_many_nodes} exceeds the engine's",
        ),
        BadRequest("another method's option", {**base, "vllm_xargs": {"beam_width": 2}}, "belongs to ['mjsd']"),
        BadRequest("misspelt option", {**base, "vllm_xargs": {"max_node": 4}}, "did you mean 'max_nodes'"),
        BadRequest(
            "prompt longer than max_model_len",
            {**base, "prompt": " ".join([prompt_word] * (max_model_len + 8))},
            "maximum context length",
        ),
        BadRequest("max_tokens above max_model_len", {**base, "max_tokens": max_model_len + 1}, "max_tokens"),
    ]


def send_bad(url: str, bad: BadRequest) -> tuple[int, str]:
    response = requests.post(f"{url}/v1/completions", json=bad.body, timeout=120)
    return response.status_code, response.text


# -------------------------------------------------------------------- a run
@dataclass
class ServerReport:
    """One server's run (what the README reports): a plugin method's, or ``none``."""

    method: str
    speculative_config: dict[str, Any]
    requests: int = 0
    failures: int = 0
    #: greedy answers with the reference's tokens, of those compared
    greedy_identical: int = 0
    greedy_total: int = 0
    #: the widest logprob difference among those with the reference's tokens
    logprob_gap: float = 0.0
    sampled_ok: int = 0
    eos_finishes: int = 0
    stop_finishes: int = 0
    faults: Faults = field(default_factory=Faults)
    bad_handled: dict[str, int] = field(default_factory=dict)
    preemptions: float = 0.0
    accepted_tokens: float = 0.0
    accepted_off_first_branch: float = 0.0
    #: of the decode steps after which the controller chose, those the whole batch rested
    steps_off_share: float = 0.0
    idle_after_waves: list[dict[str, float]] = field(default_factory=list)
    rss_mib_after_waves: list[float] = field(default_factory=list)
    #: per process (:func:`process_rss_mib`) after each wave; their sum is ``rss_mib_after_waves``
    rss_mib_per_process_after_waves: list[dict[str, float]] = field(default_factory=list)
    drafter_state_bytes_after_waves: list[float] = field(default_factory=list)
    #: wall seconds of each wave after the faults' (no fault beside it: the servers' speeds compare)
    clean_wave_seconds: list[float] = field(default_factory=list)


def compare_wave(
    report: ServerReport,
    calls: Sequence[Call],
    answers: Sequence[Answer | BaseException],
    reference: Sequence[Answer] | None,
) -> list[str]:
    """Count the wave into the report; return one line per mismatch or failure.
    Without a ``reference`` (the wave is the reference itself) greedy answers are
    only counted, not compared."""
    problems = []
    for index, (call, answer) in enumerate(zip(calls, answers)):
        report.requests += 1
        if isinstance(answer, BaseException):
            report.failures += 1
            problems.append(f"call {index} failed: {type(answer).__name__}: {answer}")
        elif call.greedy:
            if reference is None:
                continue
            expected = reference[index]
            report.greedy_total += 1
            if answer.same_tokens_as(expected):
                report.greedy_identical += 1
                report.logprob_gap = max(report.logprob_gap, answer.logprob_gap(expected))
            else:
                problems.append(f"call {index} ({call}) differs: {answer} != {expected}")
        elif len(answer.texts) == 2:
            report.sampled_ok += 1
        else:
            problems.append(f"sampled call {index} returned {len(answer.texts)} choices, not 2")
    return problems


def check_idle(report: ServerReport, url: str, pid: int | None, plugin: bool = True) -> list[str]:
    """The server after a wave: idle, KV empty, no per-request state left (the
    drafter's and draft runtime's only on a plugin server); its memory per process."""
    figures = wait_idle(url)
    if plugin:
        stats = plugin_stats(url)
        figures["drafter_live_requests"] = stats["drafter_live_requests"]
        figures["draft_runtime_live_requests"] = stats["draft_runtime_live_requests"]
        report.drafter_state_bytes_after_waves.append(stats["drafter_state_bytes"])
    report.idle_after_waves.append(figures)
    if pid is not None:
        per_process = process_rss_mib(pid)
        report.rss_mib_per_process_after_waves.append(per_process)
        report.rss_mib_after_waves.append(sum(per_process.values()))
    return [f"after a wave: {key} = {value}" for key, value in figures.items() if value]


def run_plugin_server(
    url: str,
    report: ServerReport,
    calls: Sequence[Call],
    reference: Sequence[Answer],
    bad: Sequence[BadRequest],
    prompts: Sequence[str],
    waves: int,
    faults: int,
    pid: int | None = None,
    plugin: bool = True,
) -> list[str]:
    """The whole run against one plugin server: wave, faults with bad input beside a second
    wave, then ``waves - 1`` more waves; returns every problem found (none: passed).

    ``plugin=False`` runs the same waves on the server without speculation (method
    ``none``), which answered ``reference`` as its first wave: its later waves are compared
    with it (how often vLLM's own answers change with the batch around them, in the
    dtype's rounding) and the plugin's counters are not read."""
    if plugin:
        problems = compare_wave(report, calls, asyncio.run(wave(url, calls, plugin=plugin)), reference)
    else:  # the first wave is the reference: counted, not compared with itself
        problems = compare_wave(report, calls, reference, None)
    problems += check_idle(report, url, pid, plugin)

    async def faults_beside_a_wave() -> list[Answer | BaseException]:
        second = asyncio.create_task(wave(url, calls, plugin=plugin))
        report.faults.dropped_streams, report.faults.abandoned = await asyncio.gather(
            drop_streams(url, prompts, faults), abandon_requests(url, prompts, faults)
        )
        outcomes = await asyncio.gather(*(asyncio.to_thread(send_bad, url, b) for b in bad))
        for request, (status, text) in zip(bad, outcomes):
            if 400 <= status < 500 and request.expect in text:
                report.bad_handled[request.name] = status
            else:
                problems.append(f"bad input {request.name!r}: HTTP {status}, {text[:300]}")
        return await second

    problems += compare_wave(report, calls, asyncio.run(faults_beside_a_wave()), reference)
    if report.faults.dropped_streams != faults or report.faults.abandoned != faults:
        problems.append(f"faults not all delivered: {report.faults} of {faults} each")
    problems += check_idle(report, url, pid, plugin)
    for _ in range(waves - 1):
        seconds, answers = timed_wave(url, calls, plugin)
        report.clean_wave_seconds.append(seconds)
        problems += compare_wave(report, calls, answers, reference)
        problems += check_idle(report, url, pid, plugin)
    if requests.get(f"{url}/health", timeout=10).status_code != 200:
        problems.append("/health is not 200 after the run")
    report.preemptions = prometheus(url, "vllm:num_preemptions_total")
    if plugin:
        report.accepted_tokens = prometheus(url, "vllm:spec_decode_num_accepted_tokens_total")
        stats = plugin_stats(url)
        report.accepted_off_first_branch = stats["accepted_off_first_branch"]
        report.steps_off_share = stats["steps_off"] / max(stats["steps"], 1)
    return problems


def reference_answers(url: str, calls: Sequence[Call]) -> list[Answer]:
    """The server without speculation answers the workload; it must not fail."""
    answers = asyncio.run(wave(url, calls, plugin=False))
    failed = [a for a in answers if isinstance(a, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed on the server without speculation: {failed[0]!r}")
    return answers  # type: ignore[return-value]


def finishes(calls: Sequence[Call], answers: Sequence[Answer]) -> tuple[int, int]:
    """Greedy answers that ended on EOS and on a stop string (the workload must contain both)."""
    eos = stop = 0
    for call, answer in zip(calls, answers):
        if call.greedy and answer.finish_reasons[0] == "stop":
            if call.stop:
                stop += 1
            else:
                eos += 1
    return eos, stop


# ------------------------------------------------------------------ engines
def speculative_config(name: str, draft: str | None) -> dict[str, Any] | None:
    """``method`` or ``method+global`` (``lookup_tree``'s global scope) at its defaults;
    None for ``none`` (no speculation)."""
    if name == "none":
        return None
    method, _, scope = name.partition("+")
    config: dict[str, Any] = {"method": method}
    if scope:
        config["scope"] = scope
    if draft is not None and method in ("dsbd", "mcsd", "mjsd"):
        config["model"] = draft
    return config


# -------------------------------------------------------------------- tables
#: (title, key, digits) of the load table (:func:`benchmarks.tables.markdown_table`).
LOAD_COLUMNS = (
    ("method", "method", 0),
    ("requests", "requests", 0),
    ("failures", "failures", 0),
    ("greedy tokens identical", "greedy", 0),
    ("widest logprob gap", "logprob_gap", 3),
    ("sampled n=2 ok", "sampled_ok", 0),
    ("EOS / stop finishes", "finishes", 0),
    ("dropped streams", "dropped", 0),
    ("abandoned", "abandoned", 0),
    ("bad inputs handled", "bad", 0),
    ("preemptions", "preemptions", 0),
    ("accepted tokens", "accepted_tokens", 0),
    ("off first branch", "accepted_off_first_branch", 0),
    ("steps off", "steps_off_share", 2),
    ("live requests after waves", "live", 0),
    ("RSS MiB after waves", "rss", 0),
    ("wave s (median)", "wave_s", 2),
    ("wave time vs none", "wave_vs_none", 3),
)


def process_role(key: str) -> str:
    """``VLLM::Worker_TP0 123`` -> ``VLLM::Worker_TP0``: a process's name without its pid."""
    return key.rsplit(" ", 1)[0]


def rss_table(reports: Sequence[ServerReport]) -> str:
    """RSS MiB of each server process after each wave, one row per (method, process)."""
    waves = max((len(r.rss_mib_per_process_after_waves) for r in reports), default=0)
    titles = [f"wave {i + 1}" for i in range(waves)]
    rows = []
    for report in reports:
        per_wave = report.rss_mib_per_process_after_waves
        keys = list(dict.fromkeys(key for figures in per_wave for key in figures))
        for key in [*keys, "total"]:
            values = [sum(figures.values()) if key == "total" else figures.get(key) for figures in per_wave]
            known = [v for v in values if v is not None]
            rows.append(
                {
                    "method": report.method,
                    "process": process_role(key),
                    **dict(zip(titles, values)),
                    "growth": f"{known[-1] - known[0]:+.0f}" if known else None,
                }
            )
    columns = [("method", "method", 0), ("process", "process", 0), *((t, t, 0) for t in [*titles, "growth"])]
    return markdown_table(rows, columns)


def markdown(reports: Sequence[ServerReport]) -> str:
    """One row per plugin server: what was sent, what failed, what the server held afterwards,
    and its waves' median wall time (against ``none``'s when it ran: waves after the faults')."""
    wave_s = {r.method: statistics.median(r.clean_wave_seconds) for r in reports if r.clean_wave_seconds}
    rows = [
        {
            **asdict(r),
            "finishes": f"{r.eos_finishes} / {r.stop_finishes}",
            "dropped": r.faults.dropped_streams,
            "abandoned": r.faults.abandoned,
            "bad": len(r.bad_handled),
            "greedy": f"{r.greedy_identical}/{r.greedy_total}" + ("" if r.speculative_config else " (own first wave)"),
            "live": ", ".join(
                str(int(w["drafter_live_requests"] + w["draft_runtime_live_requests"]))
                if "drafter_live_requests" in w
                else "-"
                for w in r.idle_after_waves
            ),
            "rss": ", ".join(f"{m:.0f}" for m in r.rss_mib_after_waves),
            "wave_s": wave_s.get(r.method),
            "wave_vs_none": wave_s[r.method] / wave_s["none"] if r.method in wave_s and "none" in wave_s else None,
        }
        for r in reports
    ]
    return markdown_table(rows, LOAD_COLUMNS)
