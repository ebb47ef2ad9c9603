"""benchmarks/gpu_check.py without a GPU or an engine: its commands' process groups
stopped whole, the greedy results read as far as they got, the preflight's parsing,
and the report's budgets. ``make gpu-check-dry-run`` runs the stages themselves."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from benchmarks import gpu_check, process_group
from benchmarks.gpu_check import Clock, Gpu, Settings
from benchmarks.process_group import StageError


def gone(pid: int) -> bool:
    """Whether ``pid`` ended (a zombie left to a non-reaping init counts as ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return gone(pid)


def test_run_stops_the_whole_process_group_on_its_budget(tmp_path):
    # the command's child stands for vLLM's EngineCore: it must not outlive the stage
    pid_file = tmp_path / "child.pid"
    command = ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; sleep 300"]
    clock = Clock("greedy-eager", tmp_path / "greedy-eager.log", budget_s=1.0)
    began = time.monotonic()
    with pytest.raises(StageError, match=r"greedy-eager stage's 1 s budget.*--stages greedy --budget-scale 2"):
        gpu_check.run(clock, command)
    assert time.monotonic() - began < process_group.GRACE_S
    assert wait_gone(int(pid_file.read_text()))
    assert re.search(r"stopped what was left of `sh -c .*'s process group: \['\d+ sh -c", clock.log.read_text())


def test_run_returns_stdout_and_stops_what_a_finished_command_left(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "SETTLE_S", 0.5)
    pid_file = tmp_path / "child.pid"
    clock = Clock("kernels", tmp_path / "kernels.log", budget_s=30.0)
    said = gpu_check.run(clock, ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; echo done; echo oops >&2"])
    assert said == "done\n"
    assert wait_gone(int(pid_file.read_text()))
    log = clock.log.read_text()
    assert "oops" in log and "done" in log
    assert re.search(r"process group: \['\d+ sleep 300'\]", log)


def test_run_lets_a_finished_command_tidy_up(tmp_path):
    # what ends within SETTLE_S of the command (multiprocessing's resource tracker) is left alone
    clock = Clock("kernels", tmp_path / "kernels.log", budget_s=30.0)
    assert gpu_check.run(clock, ["sh", "-c", "sleep 0.5 & echo done"]) == "done\n"
    assert "stopped" not in clock.log.read_text()


def test_messages_show_a_command_in_one_short_line():
    code = "import sys\nprint(sys.argv)\n" + "x = 1\n" * 40
    assert gpu_check.shown(["python", "-c", code, "--flag"]) == (
        "python -c 'import sys print(sys.argv) x = 1 x = 1 x = 1 x = 1 x = 1 ...' …"
    )
    assert gpu_check.shown(["sleep", "30"]) == "sleep 30"


def test_run_failure_names_the_log(tmp_path):
    clock = Clock("install", tmp_path / "install.log", budget_s=30.0)
    with pytest.raises(StageError, match=r"exited 3; see install.log"):
        gpu_check.run(clock, ["sh", "-c", "exit 3"])


def fake_venv(tmp_path: Path, script: str) -> Path:
    """A venv whose python is ``script`` (sh), for the stages that only run commands in it."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n" + script)
    python.chmod(0o755)
    return python.parent.parent


def test_greedy_stage_stopped_on_its_budget_reports_the_engines_that_finished(tmp_path):
    # the worker writes each engine's line as it finishes, then hangs in the next start
    venv = fake_venv(
        tmp_path,
        'while [ "$1" != --result ]; do shift; done\n'
        'echo \'{"engine": "none", "diverged": null, "seconds": 3.0}\' >> "$2"\n'
        'echo \'{"engine": "lookup_tree", "prompts": 4, "diverged": [[1, 5]], "seconds": 4.0}\' >> "$2"\n'
        "sleep 300\n",
    )
    s = Settings(True, tmp_path / "out", venv)
    s.out.mkdir()
    clock = Clock("greedy-eager", s.out / "greedy-eager.log", budget_s=2.0)
    with pytest.raises(StageError) as failure:
        gpu_check.stage_greedy(s, clock, "eager")
    said = str(failure.value)
    assert "budget" in said
    assert "none: the reference (3 s); lookup_tree: identical 3/4 (4 s), 1 diverged (margins not scored)" in said


def test_greedy_summary_fails_only_clear_margins():
    records = [
        {"engine": "none", "diverged": None, "seconds": 2.0},
        {"engine": "aded", "prompts": 4, "diverged": [[0, 3], [2, 7]], "seconds": 5.0},
        {"engine": "ngram", "prompts": 4, "diverged": [], "seconds": 1.0},
        {"margins": [[0, 3, 0.1], [2, 7, 0.9], [0, 8, 1.5]], "probe": [0, 8], "seconds": 2.0},
    ]
    lines, clear = gpu_check.greedy_summary(records, near_tie=0.5)
    assert lines == [
        "none: the reference (2 s)",
        "aded: identical 2/4 (5 s), 2 diverged (max float32 margin 0.900)",
        "ngram: identical 4/4 (1 s)",
        "float32 margins: 3 scored (2 s)",
        "margin self-test: prompt 0 token 8: 1.500",
    ]
    assert clear == ["aded prompt 2 token 7 (margin 0.900)"]


def test_gpu_from_nvidia_smi():
    query = "NVIDIA H200, 570.124.06, 143771, 512\n"
    banner = "| NVIDIA-SMI 570.124.06      Driver Version: 570.124.06     CUDA Version: 12.8     |\n"
    assert Gpu.parse(query, banner) == Gpu("NVIDIA H200", "570.124.06", "12.8", 143771.0, 512.0)
    assert Gpu.parse(query, "").cuda == "unknown"


def test_registry_versions_against_setup_py():
    low, high = gpu_check.supported_vllm()  # fails here, not on the GPU, if setup.py's form changes
    assert gpu_check.version_key(low) < gpu_check.version_key(high)
    said = "vllm (0.34.1)\nAvailable versions: 0.34.1, 0.33.0, 0.32.1, 0.9.2\n"
    versions = gpu_check.offered_versions(said)
    assert versions == ["0.34.1", "0.33.0", "0.32.1", "0.9.2"]
    assert gpu_check.within(versions, "0.32", "0.34") == ["0.33.0", "0.32.1"]
    assert gpu_check.offered_versions("ERROR: No matching distribution found for vllm") == []


def test_torch_that_sees_no_gpu_names_the_driver_fix(tmp_path):
    s = Settings(False, tmp_path, tmp_path / "venv")
    probe = {"vllm": True, "torch": "2.9.0+cu129", "cuda": "12.9", "available": False}
    with pytest.raises(StageError, match=r"upgrade the NVIDIA driver to one for CUDA >= 12.9"):
        gpu_check._torch_cuda(s, probe, Gpu("H200", "550.1", "12.4", 1.0, 0.0))
    with pytest.raises(StageError, match=r"CUDA_VISIBLE_DEVICES"):
        gpu_check._torch_cuda(s, probe, Gpu("H200", "570.1", "12.9", 1.0, 0.0))


def test_finished_engines_of_a_compare_run(tmp_path):
    (tmp_path / "logs").mkdir()
    for name in ["ngram-k4.result.json", "lookup_tree.result.json", "lookup_tree.log", "aded.progress"]:
        (tmp_path / "logs" / name).write_text("{}")
    assert gpu_check.finished_engines(tmp_path) == ["lookup_tree", "ngram-k4"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], [s.name for s in gpu_check.STAGES]),
        (["--passes", "eager"], [s.name for s in gpu_check.STAGES if s.name != "greedy-compiled"]),
        (["--stages", "greedy", "--passes", "compiled", "eager"], ["models", "greedy-eager", "greedy-compiled"]),
        (["--stages", "preflight", "kernels"], ["preflight", "kernels"]),
    ],
)
def test_stage_selection(tmp_path, argv, expected):
    args = gpu_check.parse_args([*argv, "--out", str(tmp_path)])
    assert [s.name for s in gpu_check.selected(args, gpu_check.settings_of(args))] == expected


def test_report_states_each_stage_against_its_budget(tmp_path, monkeypatch):
    def slow(s: Settings, clock: Clock) -> str:
        return gpu_check.run(clock, ["sleep", "30"])

    monkeypatch.setattr(
        gpu_check,
        "STAGES",
        [
            gpu_check.Stage("preflight", lambda s, clock: "fine", gpu_s=100, dry_s=10),
            gpu_check.Stage("kernels", slow, gpu_s=100, dry_s=0.4),
            gpu_check.Stage("serve", lambda s, clock: "never", gpu_s=100, dry_s=10),
        ],
    )
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = gpu_check.main(["--cpu-dry-run", "--out", str(tmp_path), "--stages", "preflight", "kernels"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    report = (tmp_path / "report.md").read_text()
    assert code == 1
    assert "- **preflight** ok (0 s of 10 s): fine" in report
    assert re.search(r"- \*\*kernels\*\* FAILED \(\d s of 0 s\): `sleep 30` ran past the kernels stage's 0 s", report)
    assert re.search(r"FAILED at stage kernels in \d s of the stages' 10 s budget", report)
    assert "serve" not in report
