"""Commands that leave nothing running: each in its own process group, stopped whole.

Python's ``subprocess`` timeouts kill only the direct child; vLLM's EngineCore
processes (and a pytest's workers) are its children and would keep running, and
on a GPU keep its memory. The GPU runners (``gpu_check.py``, ``gpu_kernels.py``)
start every command with ``start_new_session=True`` and stop it with
:func:`stop_group`. Standard library only: ``gpu_kernels.py`` runs on a box with
torch and Triton alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

#: Seconds between SIGTERM to a command's process group and SIGKILL to what is left of it.
GRACE_S = 15.0


def stop_group(process: subprocess.Popen, grace_s: float = GRACE_S, settle_s: float = 0.0) -> list[str]:
    """After ``settle_s`` for it to end by itself, SIGTERM to what is left of ``process``'s process
    group and SIGKILL after ``grace_s``; returns what was left. vLLM's EngineCore processes are the
    command's children: killing the command alone would leave them holding the GPU's memory."""
    _wait_group(process, settle_s)
    if not _group_alive(process):
        return []
    left = group_members(process.pid) or [f"process group {process.pid}"]
    _signal_group(process.pid, signal.SIGTERM)
    _wait_group(process, grace_s)
    if _group_alive(process):
        _signal_group(process.pid, signal.SIGKILL)
    process.wait()
    return left


def group_members(pgid: int) -> list[str]:
    """The live processes of group ``pgid`` as "pid command", for the log (Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _parent, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(group) == pgid and state != "Z":
                command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{stat.parent.name} {command.strip()[:120]}")
        except (OSError, ValueError):
            continue  # ended while read
    return found


def _wait_group(process: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while _group_alive(process) and time.monotonic() < deadline:
        time.sleep(0.2)


def _group_alive(process: subprocess.Popen) -> bool:
    """Whether a live process is left in the group: zombies do not count (an init that reaps
    orphans late, as in some containers, would otherwise hold every stage up)."""
    process.poll()  # reap the leader
    if Path("/proc/self/stat").exists():
        return bool(group_members(process.pid))
    return _signal_group(process.pid, 0)


def _signal_group(pgid: int, signum: int) -> bool:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` so that a reader polling ``path`` never sees it half written."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


# ------------------------------------------------ the GPU runners' stages and records
class StageError(RuntimeError):
    """A stage's failure, said in one line."""


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, written whole and closed: a reader (:func:`read_records`) sees every finished record."""
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines written so far, whole lines only (a stopped writer may leave its last line cut)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]
