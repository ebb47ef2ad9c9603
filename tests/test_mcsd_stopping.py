"""``mcsd``'s stop model: features, training, the file and its pair check."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_specbeam.core.config import SpecbeamConfigError
from vllm_specbeam.methods.mcsd import stopping


def test_features_are_the_top_probabilities_and_the_entropy() -> None:
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [30.0, 0.0, 0.0, 0.0]])
    features = stopping.stop_features(logits)
    assert features.shape == (2, stopping.NUM_FEATURES) and features.dtype == torch.float32
    probs = torch.softmax(logits, -1)
    expected_top = torch.sort(probs, descending=True).values
    torch.testing.assert_close(features[:, :4], expected_top)
    assert torch.all(features[:, 4 : stopping.NUM_TOP] == 0)  # 4 tokens: padded to ten
    torch.testing.assert_close(features[:, -1], -(probs * probs.log()).sum(-1))
    assert features[1, -1] < 1e-9 and torch.isfinite(features).all()  # near one-hot: entropy ~0, no nan


def test_features_of_a_real_vocabulary_width() -> None:
    features = stopping.stop_features(torch.randn(3, 151936))
    assert features.shape == (3, stopping.NUM_FEATURES)
    assert math.isclose(float(features[0, -1]), 11.4, abs_tol=0.6)  # near log(151936) for a flat-ish row
    assert torch.all(features[:, : stopping.NUM_TOP - 1] >= features[:, 1 : stopping.NUM_TOP])


def toy_rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax rows of varied sharpness; label: the top probability exceeds one half."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 50, generator=generator) * torch.rand(n, 1, generator=generator) * 6
    features = stopping.stop_features(logits).numpy()
    return features, (features[:, 0] > 0.5).astype(np.float32)


def test_training_learns_a_separable_signal_and_not_noise() -> None:
    features, labels = toy_rows(3000, 0)
    assert 0.2 < labels.mean() < 0.8
    model, report = stopping.train_stop_model(features, labels, epochs=20, seed=0)
    assert report.heldout_accuracy > 0.95 and report.heldout_rows == 600
    # the same rows with shuffled labels: nothing to learn, so no better than the majority guess
    shuffled = np.random.default_rng(0).permutation(labels)
    _, noise = stopping.train_stop_model(features, shuffled, epochs=20, seed=0)
    assert noise.heldout_accuracy < max(labels.mean(), 1 - labels.mean()) + 0.05
    again, _ = stopping.train_stop_model(features, labels, epochs=20, seed=0)
    rows = torch.from_numpy(features[:50])
    assert torch.equal(model.probability(rows), again.probability(rows))  # deterministic for a seed


def test_training_refuses_bad_data() -> None:
    features, labels = toy_rows(100, 1)
    with pytest.raises(ValueError, match="too few"):
        stopping.train_stop_model(features[:10], labels[:10])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        stopping.train_stop_model(features, labels * 2)
    with pytest.raises(ValueError, match="must be"):
        stopping.train_stop_model(features[:, :5], labels)


def pair(target: str = "t", draft: str = "d") -> stopping.PairIdentity:
    return stopping.PairIdentity(target, draft, f"{target}-fp", f"{draft}-fp")


def test_a_saved_model_loads_identically_and_is_small(tmp_path: Path) -> None:
    features, labels = toy_rows(500, 2)
    model, report = stopping.train_stop_model(features, labels, epochs=3)
    path = stopping.save_stop_model(tmp_path / "stop", model, pair(), report)
    assert path.stat().st_size < 16 * 1024
    loaded = stopping.load_stop_model(tmp_path / "stop", pair())
    rows = torch.from_numpy(features)
    torch.testing.assert_close(loaded.probability(rows), model.probability(rows), atol=1e-5, rtol=0)
    assert json.loads(path.read_text())["report"]["heldout_accuracy"] == report.heldout_accuracy


def test_loading_names_the_problem_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(SpecbeamConfigError, match="vllm-specbeam mcsd train"):
        stopping.load_stop_model(tmp_path / "missing")
    features, labels = toy_rows(100, 3)
    model, report = stopping.train_stop_model(features, labels, epochs=1)
    stopping.save_stop_model(tmp_path, model, pair("big", "small"), report)
    with pytest.raises(SpecbeamConfigError, match=r"trained for target 'big' with draft 'small'.*runs target 'x'"):
        stopping.load_stop_model(tmp_path, pair("x", "y"))
    (tmp_path / stopping.STOP_MODEL_FILE).write_text("{not json")
    with pytest.raises(SpecbeamConfigError, match="not a stop model"):
        stopping.load_stop_model(tmp_path)


def test_pair_identity_follows_the_models_configuration(tiny_model: str, tiny_draft: str, tmp_path: Path) -> None:
    from tiny_model import build_tiny_model

    deeper = str(build_tiny_model(tmp_path / "deeper", seed=1, num_hidden_layers=3))
    same = stopping.PairIdentity.of(tiny_model, tiny_draft)
    assert same.target_fingerprint == same.draft_fingerprint  # one configuration, other weights
    other = stopping.PairIdentity.of(tiny_model, deeper)
    assert not other.matches(same) and other.matches(stopping.PairIdentity.of(tiny_model, deeper))
    with pytest.raises(SpecbeamConfigError, match="cannot read the configuration"):
        stopping.PairIdentity.of(str(tmp_path / "nothing"), tiny_draft)
