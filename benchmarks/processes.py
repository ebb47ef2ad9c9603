"""Engine processes: start, watch, stop and take turns.

One process per engine (a worker of ``benchmarks.worker``, or a ``vllm-specbeam
serve`` server), so one engine's memory and threads never disturb another's
timing and the peak RSS of its process tree is its own. Stopping a process
stops its whole tree: vLLM's engine core and workers outlive a killed parent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import requests

from benchmarks.host import ROOT
from benchmarks.process_group import atomic_write

if TYPE_CHECKING:
    from benchmarks.plan import EngineSpec
    from benchmarks.records import Job

#: Set before vLLM is imported (worker mode) and inherited by the workers: an
#: explicit KV cache size, both cores for the model, and collective_rpc with
#: our own function.
ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
#: vLLM's CPU worker warns that speculative decoding on x86 without Intel
#: OpenMP in LD_PRELOAD loses speed; vLLM's CPU build installs it next to torch.
INTEL_OPENMP = Path(sys.prefix) / "lib" / "libiomp5.so"
#: ``--interleave``: pause between one engine's timed run and the next's, longer than
#: Intel OpenMP's default 200 ms of spinning threads after their last parallel work
INTERLEAVE_SETTLE_S = 0.3


# ------------------------------------------------------------ environment
def add_intel_openmp_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--intel-openmp",
        choices=["auto", "off"],
        default="auto",
        help=f"auto: preload {INTEL_OPENMP} into every engine on x86 when it is there (vLLM's CPU advice); "
        "off: leave LD_PRELOAD as it is (default %(default)s)",
    )


def set_engine_environment(intel_openmp: str) -> None:
    """Set ``ENV_DEFAULTS`` (the caller's values win) and put the venv's
    Intel OpenMP into ``LD_PRELOAD`` for every engine this process starts
    (a preload only acts at a process's start), as vLLM's CPU
    docs ask on x86. ``intel_openmp``: "auto" (when the library is there) or "off".
    An OpenMP the caller already preloads is kept alone: vLLM 0.32's
    utils/ompmultiprocessing.py refuses Intel and GNU OpenMP together.
    The result's environment records the outcome."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    preloaded = os.environ.get("LD_PRELOAD", "")
    if intel_openmp == "off" or any(name in preloaded for name in ("libiomp", "libomp", "libgomp")):
        return
    if platform.machine() in ("x86_64", "AMD64") and INTEL_OPENMP.is_file():
        os.environ["LD_PRELOAD"] = " ".join(filter(None, [str(INTEL_OPENMP), preloaded]))
        print(f"engines start with LD_PRELOAD={os.environ['LD_PRELOAD']} (--intel-openmp off to leave it)")


# ------------------------------------------------------------ processes
class TreeMonitor:
    """Peak RSS of a process and all its descendants (vLLM's front end,
    engine core and workers), sampled in a thread every ``interval`` seconds;
    ``on_sample`` runs at each sample (progress bars)."""

    def __init__(self, pid: int, interval: float = 0.5, on_sample: Callable[[], None] | None = None) -> None:
        self.pid, self.interval, self.on_sample = pid, interval, on_sample
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> TreeMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (a last ``on_sample`` included)."""
        self._stop.set()
        self._thread.join()
        if self.on_sample:
            self.on_sample()

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                total = 0
                for process in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        total += process.memory_info().rss
                self.peak_bytes = max(self.peak_bytes, total)
            except psutil.NoSuchProcess:
                pass
            if self.on_sample:
                self.on_sample()
            self._stop.wait(self.interval)


def stop_process_tree(pid: int, timeout: float = 10.0) -> None:
    """Terminate a process and every process under it, killing what is still
    alive after ``timeout`` seconds."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def failure_line(log: Path) -> str:
    """The last exception line of a log (vLLM's shutdown chatter follows the
    traceback), or its last line."""
    lines = log.read_text(errors="replace").strip().splitlines() or [""]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", line)]
    return (errors or lines)[-1]


# ------------------------------------------------------------ engine workers
@dataclass
class WorkerExit:
    """How a worker ended: its exit code and its process tree's peak RSS."""

    code: int
    peak_rss_mib: float


@dataclass
class RunningWorker:
    """An engine worker started by :func:`start_worker`."""

    proc: subprocess.Popen[bytes]
    monitor: TreeMonitor
    progress: Path
    log: IO[str]

    def steps_done(self) -> int:
        """Steps the worker reported: 1 once its engine is started and warm, then 1 a timed run."""
        try:
            return int(self.progress.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def wait(self) -> WorkerExit:
        """How it ended; stops its process tree if interrupted."""
        try:
            return WorkerExit(self.proc.wait(), self.monitor.peak_mib)
        except BaseException:  # Ctrl-C, or SIGTERM through the entry script's handler
            self.stop()
            raise
        finally:
            self.monitor.stop()
            self.log.close()

    def stop(self) -> None:
        stop_process_tree(self.proc.pid)


class Progress(Protocol):
    """What advances as workers report steps (a tqdm bar)."""

    def update(self, n: int) -> object: ...


def start_worker(job: Job, log: Path, bar: Progress) -> RunningWorker:
    """Start one engine worker (``python -m benchmarks.worker JOB``, the repository on
    its ``PYTHONPATH``); it advances ``bar`` as the worker reports finished steps."""
    job_file = Path(job.result).with_suffix(".job.json")
    job_file.write_text(json.dumps(asdict(job)))
    progress = Path(job.progress)
    progress.unlink(missing_ok=True)  # a previous run's count into the same --out
    seen = 0

    def advance() -> None:
        nonlocal seen
        done = worker.steps_done()
        bar.update(done - seen)
        seen = done

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = open(log, "w")  # noqa: SIM115 (closed by RunningWorker.wait)
    command = [sys.executable, "-m", "benchmarks.worker", str(job_file)]
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    worker = RunningWorker(proc, TreeMonitor(proc.pid, on_sample=advance), progress, out)
    worker.monitor.start()
    return worker


def run_worker(job: Job, log: Path, bar: Progress) -> WorkerExit:
    """Run one engine worker to its end."""
    return start_worker(job, log, bar).wait()


# ------------------------------------------------------------ turns
def engine_schedule(engines: Sequence[EngineSpec], rounds: int) -> list[tuple[int, EngineSpec]]:
    """``(round, engine)`` in run order: the engines in order, then reversed, and so on, the
    baseline last in every round, so slow drift on the machine hits every engine alike.

    Example: engines ``[a, b, none]`` over 3 rounds run ``a b none b a none a b none``.
    """
    methods = [e for e in engines if e.kind != "baseline"]
    baseline = [e for e in engines if e.kind == "baseline"]
    return [(r, e) for r in range(rounds) for e in (methods if r % 2 == 0 else methods[::-1]) + baseline]


def wait_for(path: Path, text: str | None = None, poll_s: float = 0.005) -> str:
    """Wait until ``path`` exists (and holds ``text``, when given); its content."""
    while True:
        with contextlib.suppress(FileNotFoundError):
            content = path.read_text()
            if text is None or content == text:
                return content
        time.sleep(poll_s)


def run_interleaved(jobs: Sequence[Job], logs: Path, bar: Progress) -> dict[str, RunningWorker]:
    """``--interleave``: start every job's worker, one after the other once the last is
    warm, then hand out their timed runs in turns; the workers, still running (the
    baseline waits to score), by job name.

    Turns go round the jobs, reversed every round, one timed run each:
    jobs ``[a, b, none]`` with 2 runs each run ``a b none none b a``. A turn
    is ``"<job> <its run index>"`` in the file ``logs/turn`` (:func:`wait_for`); after each
    run the next turn waits ``INTERLEAVE_SETTLE_S``, so the last engine's threads have gone to sleep.
    """
    turn = logs / "turn"
    turn.unlink(missing_ok=True)
    workers: dict[str, RunningWorker] = {}

    def reached(worker: RunningWorker, steps: int) -> None:
        while worker.steps_done() < steps and worker.proc.poll() is None:
            time.sleep(0.01)

    try:
        # One start at a time: engines starting together on few cores starve each
        # other's OpenMP teams (3 SmolLM2 engines on 2 cores: none warm after 4 minutes).
        for job in jobs:
            job.turn = str(turn)
            workers[job.name] = start_worker(job, logs / f"{job.name}.log", bar)
            reached(workers[job.name], 1)
        runs = {job.name: job.timed_runs for job in jobs}
        for k in range(max(runs.values())):
            for job in jobs if k % 2 == 0 else jobs[::-1]:
                if k < runs[job.name] and workers[job.name].proc.poll() is None:
                    atomic_write(turn, f"{job.name} {k}")
                    reached(workers[job.name], 2 + k)
                    time.sleep(INTERLEAVE_SETTLE_S)
    except BaseException:
        for worker in workers.values():
            worker.stop()
        raise
    return workers


# ------------------------------------------------------------ servers
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Server:
    url: str
    pid: int
    #: what ``running_server``'s ``watch`` returned on entering (None without one)
    watcher: Any = None


@contextmanager
def running_server(
    model: str,
    speculative_config: dict[str, Any] | None,
    log_path: Path,
    *args: str,
    startup_seconds: float = 600.0,
    env: dict[str, str] | None = None,
    port: int | None = None,
    dev_mode: bool = True,
    watch: Callable[[int], AbstractContextManager[Any]] | None = None,
) -> Iterator[Server]:
    """``vllm-specbeam serve MODEL`` in a subprocess on ``port`` (a free one by
    default), with dev mode on for ``/collective_rpc`` unless ``dev_mode`` is
    False; yields it once ``/health`` answers. ``watch(pid)`` (e.g. a memory
    monitor) is entered as soon as the process starts and left before it stops."""
    port = free_port() if port is None else port
    command = [
        sys.executable,
        "-m",
        "vllm_specbeam.adapter.cli",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(["--speculative-config", json.dumps(speculative_config)] if speculative_config else []),
        *args,
    ]
    environment = {**os.environ, **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {}), **(env or {})}
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + startup_seconds
        try:
            with watch(process.pid) if watch else nullcontext() as watcher:
                while True:
                    if process.poll() is not None:
                        raise RuntimeError(f"server exited with {process.returncode}; see {log_path}")
                    try:
                        if requests.get(f"{url}/health", timeout=2).status_code == 200:
                            break
                    except requests.ConnectionError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"server did not start in {startup_seconds:.0f} s; see {log_path}")
                    time.sleep(1)
                yield Server(url, process.pid, watcher)
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
