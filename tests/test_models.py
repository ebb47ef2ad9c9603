"""benchmarks/models.py: the order a model name resolves in, and the registry
route's guarantees (pinned sums, data files only, no half model left behind).

Offline and fast: the hub check, pip's download and the conversion are
replaced by fakes; fake wheels are small zips built here.
"""

from __future__ import annotations

import email.message
import hashlib
import io
import re
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from benchmarks import models

PARTS = [b"GGUF first slice " * 64, b"second slice " * 64]
FAKE = "fake-model"
FAKE_HUB = "fake-org/Fake-Model"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fail(*_args: object) -> None:
    pytest.fail("this step must not be reached")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reaches the network or the machine's hub cache."""
    monkeypatch.setattr(urllib.request, "urlopen", fail)
    monkeypatch.setattr(models, "in_hub_cache", lambda name: False)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("SPECBEAM_MODELS", str(path))
    return path


class Registry:
    """Fake wheels for a fake known model, and the fake conversion's record."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sentinel = tmp_path / "wheel-code-ran"
        self.downloads: list[str] = []
        self.converted: list[bytes] = []
        self.wheel_sums = [sha(self.wheel_bytes(i)) for i in (1, 2)]
        self.gguf_sum = sha(b"".join(PARTS))
        monkeypatch.setattr(models, "download_wheel", self.download)
        monkeypatch.setattr(models, "convert", self.convert)
        self.register(monkeypatch)

    def register(self, monkeypatch: pytest.MonkeyPatch) -> None:
        wheels = models.chunk_wheels("fake-part", "0.0.1", self.wheel_sums)
        monkeypatch.setitem(models.KNOWN, FAKE, models.KnownModel(FAKE, FAKE_HUB, wheels, self.gguf_sum))

    def wheel_bytes(self, i: int) -> bytes:
        """A wheel whose code would leave a sentinel file if it ever ran."""
        files = {
            f"fake_part{i}/__init__.py": f"open({str(self.sentinel)!r}, 'w').write('ran')\n".encode(),
            f"fake_part{i}/data/part{i:02d}.bin": PARTS[i - 1],
            f"fake_part{i}-0.0.1.dist-info/METADATA": b"Name: fake\n",
        }
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            for name, data in files.items():  # fixed timestamps: the same bytes, the same sum, every time
                archive.writestr(zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0)), data)
        return buffer.getvalue()

    def download(self, wheel: models.Wheel, dest: Path) -> Path:
        self.downloads.append(wheel.spec)
        path = dest / f"{wheel.package.replace('-', '_')}-{wheel.version}-py3-none-any.whl"
        path.write_bytes(self.wheel_bytes(int(wheel.package.removeprefix("fake-part"))))
        return path

    def convert(self, gguf: Path, out: Path) -> None:
        self.converted.append(gguf.read_bytes())
        out.mkdir()
        (out / "config.json").write_text("{}")


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Registry:
    return Registry(tmp_path, monkeypatch)


def no_hub(monkeypatch: pytest.MonkeyPatch, reason: str = "HF_HUB_OFFLINE is set") -> None:
    monkeypatch.setattr(models, "hub_unreachable", lambda: reason)


# ------------------------------------------------------------- resolution order
def test_local_directory_wins_over_cache_and_hub(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (cache / "smollm2-135m-instruct").mkdir(parents=True)
    (cache / "smollm2-135m-instruct" / "config.json").write_text("{}")
    mine = tmp_path / "work" / "smollm2-135m-instruct"
    mine.mkdir(parents=True)
    monkeypatch.setattr(models, "hub_unreachable", fail)
    monkeypatch.chdir(mine.parent)
    assert models.resolve("smollm2-135m-instruct") == str(mine)
    assert models.resolve(str(mine)) == str(mine)


def test_cached_known_model_by_short_or_hub_name(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    converted = cache / "qwen-coder-0.5b"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    monkeypatch.setattr(models, "hub_unreachable", fail)
    monkeypatch.setattr(models, "download_wheel", fail)
    assert models.resolve("qwen-coder-0.5b") == str(converted)
    assert models.resolve("Qwen/Qwen2.5-Coder-0.5B-Instruct") == str(converted)


def test_half_written_cache_dir_is_not_a_model(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (cache / "qwen-coder-1.5b").mkdir(parents=True)  # no config.json
    monkeypatch.setattr(models, "hub_unreachable", lambda: None)
    assert models.resolve("qwen-coder-1.5b") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def test_reachable_hub_gets_the_hub_name(cache: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "hub_unreachable", lambda: None)
    assert models.resolve("qwen-coder-1.5b") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert models.resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert models.resolve("some-org/unknown-model") == "some-org/unknown-model"
    assert models.resolve(FAKE) == FAKE_HUB
    assert registry.downloads == [] and not cache.exists()


def test_hub_cache_serves_without_a_hub(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_hub(monkeypatch)
    monkeypatch.setattr(models, "in_hub_cache", lambda name: name == "some-org/cached")
    assert models.resolve("some-org/cached") == "some-org/cached"


def test_unknown_name_without_hub_names_the_fix(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_hub(monkeypatch)
    with pytest.raises(models.ModelError) as err:
        models.resolve("some-org/unknown-model")
    message = str(err.value)
    assert "'some-org/unknown-model'" in message and "HF_HUB_OFFLINE is set" in message
    assert "smollm2-135m-instruct" in message and "qwen-coder-1.5b" in message
    assert "model directory" in message


def test_missing_path_is_refused_before_the_hub(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "hub_unreachable", fail)
    with pytest.raises(models.ModelError, match="no such directory"):
        models.resolve(str(tmp_path / "nowhere"))


# ------------------------------------------------------------- registry route
def test_no_hub_takes_the_registry_route(cache: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    no_hub(monkeypatch)
    assert models.resolve(FAKE_HUB) == str(cache / FAKE)
    assert registry.downloads == ["fake-part1==0.0.1", "fake-part2==0.0.1"]
    assert registry.converted == [b"".join(PARTS)]  # the data files, in order, and nothing else
    assert [p.name for p in cache.iterdir()] == [FAKE]  # no partial directory, GGUF or wheel left
    assert models.resolve(FAKE) == str(cache / FAKE) and len(registry.downloads) == 2  # cached now


def test_only_data_files_are_taken_from_wheels(
    cache: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_hub(monkeypatch)
    models.resolve(FAKE)
    assert not registry.sentinel.exists()
    assert "fake_part1" not in sys.modules and "fake_part2" not in sys.modules
    assert [p.relative_to(cache).as_posix() for p in cache.rglob("*")] == [FAKE, f"{FAKE}/config.json"]


def test_wheel_sha256_mismatch_is_refused_and_leaves_nothing(
    cache: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_hub(monkeypatch)
    registry.wheel_sums[1] = "0" * 64
    registry.register(monkeypatch)
    with pytest.raises(models.ModelError) as err:
        models.resolve(FAKE)
    message = str(err.value)
    actual = sha(registry.wheel_bytes(2))
    assert "fake-part2==0.0.1" in message and "0" * 64 in message and actual in message
    assert "Retry" in message
    assert registry.converted == []
    assert list(cache.iterdir()) == []


def test_gguf_sha256_mismatch_is_refused_and_leaves_nothing(
    cache: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_hub(monkeypatch)
    registry.gguf_sum = sha(b"other bytes")
    registry.register(monkeypatch)
    with pytest.raises(models.ModelError, match=f"GGUF assembled for {FAKE}.*{sha(b''.join(PARTS))}"):
        models.resolve(FAKE)
    assert registry.converted == []
    assert list(cache.iterdir()) == []


def test_interrupted_conversion_leaves_no_model(
    cache: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_hub(monkeypatch)

    def interrupted(gguf: Path, out: Path) -> None:
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.resolve(FAKE)
    assert list(cache.iterdir()) == []
    monkeypatch.setattr(models, "convert", registry.convert)
    assert models.resolve(FAKE) == str(cache / FAKE)


# ------------------------------------------------------------- hub check, CLI, table
def test_hub_check_honours_offline_and_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.hub_unreachable() == "HF_HUB_OFFLINE is set"  # urlopen would fail the test
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://hub-mirror.test")
    asked: list[str] = []

    def answers(request: urllib.request.Request, timeout: float) -> None:
        asked.append(request.full_url)
        raise urllib.error.HTTPError(request.full_url, 404, "Not Found", email.message.Message(), None)

    monkeypatch.setattr(urllib.request, "urlopen", answers)
    assert models.hub_unreachable() is None and asked == ["http://hub-mirror.test"]

    def down(request: urllib.request.Request, timeout: float) -> None:
        raise urllib.error.URLError("connection refused")

    monkeypatch.setattr(urllib.request, "urlopen", down)
    reason = models.hub_unreachable()
    assert reason is not None and "http://hub-mirror.test" in reason and "connection refused" in reason


def test_cli_path_never_downloads_and_fetch_prints_paths(
    cache: Path, registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    no_hub(monkeypatch)
    assert models.main(["path", FAKE]) == 1
    assert f"models.py fetch {FAKE}" in capsys.readouterr().err and registry.downloads == []
    assert models.main(["fetch", FAKE, str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(cache / FAKE), str(tmp_path)]
    assert models.main(["path", FAKE]) == 0
    assert capsys.readouterr().out.strip() == str(cache / FAKE)


def test_pinned_table_takes_one_data_file_per_wheel() -> None:
    assert [len(m.wheels) for m in models.KNOWN.values()] == [1, 6, 22]
    for model in models.KNOWN.values():
        assert models.known_model(model.hub) is model and models.known_model(model.short) is model
        for wheel in model.wheels:
            assert wheel.member.startswith(wheel.package.replace("-", "_") + "/")
            assert wheel.member.endswith((".gguf", ".bin"))
            assert len({wheel.sha256, model.gguf_sha256}) == 2
            # hashlib's hexdigest form, the one the route compares against
            assert all(re.fullmatch("[0-9a-f]{64}", s) for s in (wheel.sha256, model.gguf_sha256))
