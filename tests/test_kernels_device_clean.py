"""tests/kernels builds every tensor on the test's device.

Those tests pass on a CPU under ``TRITON_INTERPRET=1`` whatever device their
tensors are on; on a GPU a tensor built without ``device=`` lands on the CPU
next to CUDA ones and the test fails on a device error (issue 56). This check
finds such constructors statically, so a CPU-only run catches them too.
"""

from __future__ import annotations

import ast
from pathlib import Path

KERNEL_TESTS = Path(__file__).parent / "kernels"
#: torch functions that build a tensor and default to the CPU without ``device=``
CONSTRUCTORS = frozenset(
    {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "eye"}  # from data or a fill value
    | {"arange", "linspace", "randn", "rand", "randint", "randperm"}  # ranges and random draws
)


def device_less_constructors(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: message`` for every ``torch.<constructor>(...)`` without ``device=``,
    and every ``torch.from_numpy`` (which takes no device)."""
    problems: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
        ):
            continue
        name = node.func.attr
        if name == "from_numpy":
            problems.append((node.lineno, "torch.from_numpy has no device; use torch.as_tensor(array, device=DEVICE)"))
        elif name in CONSTRUCTORS and not any(kw.arg == "device" for kw in node.keywords):
            problems.append((node.lineno, f"torch.{name}(...) without device=; pass device=DEVICE"))
    return [f"{filename}:{line}: {message}" for line, message in sorted(problems)]


def test_kernel_tests_pass_a_device_to_every_tensor_constructor() -> None:
    paths = sorted(KERNEL_TESTS.glob("*.py"))
    assert paths, f"no kernel tests in {KERNEL_TESTS}"
    problems = [
        problem
        for path in paths
        for problem in device_less_constructors(path.read_text(), str(path.relative_to(KERNEL_TESTS.parent.parent)))
    ]
    assert not problems, (
        "tensors built on the CPU by default mix with CUDA tensors on a GPU (device errors);\n"
        "build them on the test's DEVICE (random values: device='cpu' with the CPU generator, then .to(DEVICE)):\n"
        + "\n".join(problems)
    )


def test_the_check_reports_a_planted_cpu_tensor() -> None:
    """The check above cannot pass by finding nothing."""
    source = "import torch\nd = 'cuda'\na = torch.tensor([1, 2])\nb = torch.tensor([1], device=d)\n"
    source += "c = torch.from_numpy(x)\ne = torch.zeros_like(a)\n"
    assert device_less_constructors(source, "planted.py") == [
        "planted.py:3: torch.tensor(...) without device=; pass device=DEVICE",
        "planted.py:5: torch.from_numpy has no device; use torch.as_tensor(array, device=DEVICE)",
    ]
