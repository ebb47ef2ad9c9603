"""MCSD's stop model: when drafting one level deeper stops paying.

After each draft level the drafter asks, for every frontier node, how likely
the target is to accept the token the draft would propose next. Lu et al.
(arXiv 2409.10644) read that from the draft's last hidden state or, cheaper,
from ``q`` itself; here the cheap features: the draft's ten largest
probabilities and its entropy, through a small MLP with a sigmoid.

The model is trained per target/draft pair (``vllm-specbeam mcsd train``)
and stored as a small JSON file with the pair's identity, so an engine
serving another pair refuses it at start-up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vllm_specbeam.core.config import SpecbeamConfigError

NUM_TOP = 10
#: the draft's top ``NUM_TOP`` probabilities (descending), then its entropy in nats
NUM_FEATURES = NUM_TOP + 1
FEATURES = "top10+entropy"
STOP_MODEL_FILE = "stop_model.json"
FORMAT = 1
TRAIN_HINT = (
    'train one with `vllm-specbeam mcsd train --target T --draft D --prompts FILE --out DIR` and pass "stop_model": DIR'
)


def stop_features(logits: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` draft logits -> ``[n, NUM_FEATURES]`` float32 features (no host sync)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    probs = logp.exp()
    entropy = -(probs * logp.clamp(min=torch.finfo(torch.float32).min)).sum(dim=-1, keepdim=True)  # [n, 1]
    top = torch.topk(probs, min(NUM_TOP, probs.shape[-1]), dim=-1).values  # [n, <= NUM_TOP]
    top = torch.nn.functional.pad(top, (0, NUM_TOP - top.shape[-1]))
    return torch.cat([top, entropy], dim=-1)


class StopModel(torch.nn.Module):
    """``NUM_FEATURES -> hidden -> 1``; the sigmoid estimates that the draft's next token is accepted."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.hidden = hidden
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(NUM_FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features).squeeze(-1)  # [n] logits

    @torch.no_grad()
    def probability(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self(features))  # [n]


def _fingerprint(model: str) -> str:
    """The model's configuration (what identifies its architecture and sizes), hashed."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model).to_dict()
    except (OSError, ValueError) as error:
        raise SpecbeamConfigError(f"cannot read the configuration of model {model!r} ({error})") from error
    kept = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("transformers_version", "dtype")}
    kept.pop("torch_dtype", None)
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PairIdentity:
    """The target/draft pair a stop model was trained for.

    Compared by the models' configurations, so a hub name and a local copy of
    the same model match; two checkpoints of one architecture do too.
    """

    target: str
    draft: str
    target_fingerprint: str
    draft_fingerprint: str

    @classmethod
    def of(cls, target: str, draft: str) -> PairIdentity:
        return cls(target, draft, _fingerprint(target), _fingerprint(draft))

    def matches(self, other: PairIdentity) -> bool:
        return (self.target_fingerprint, self.draft_fingerprint) == (other.target_fingerprint, other.draft_fingerprint)


@dataclass
class TrainReport:
    rows: int
    #: mean label over all rows
    positive_rate: float
    train_accuracy: float
    heldout_rows: int
    #: accuracy of ``probability >= 0.5`` against ``label >= 0.5`` on the held-out rows
    heldout_accuracy: float
    #: held-out binary cross-entropy, and that of always predicting the training rows' mean label
    heldout_log_loss: float
    constant_log_loss: float
    epochs: int


def _accuracy(model: StopModel, features: torch.Tensor, labels: torch.Tensor) -> float:
    if not len(labels):
        return float("nan")
    return float(((model.probability(features) >= 0.5) == (labels >= 0.5)).float().mean())


def _log_loss(probability: torch.Tensor, labels: torch.Tensor) -> float:
    if not len(labels):
        return float("nan")
    return float(torch.nn.functional.binary_cross_entropy(probability.clamp(1e-6, 1 - 1e-6), labels))


def train_stop_model(
    features: np.ndarray,
    labels: np.ndarray,
    *,
    epochs: int = 100,
    learning_rate: float = 1e-2,
    hidden: int = 32,
    holdout: float = 0.2,
    seed: int = 0,
    batch_size: int = 256,
) -> tuple[StopModel, TrainReport]:
    """BCE with Adam on ``labels`` in [0, 1] (hard or soft); a seeded held-out split.

    A pair collects a few thousand rows in minutes, so the default runs a few
    hundred Adam steps (the paper's ten epochs were over far more rows).
    """
    features = np.asarray(features, np.float32)
    labels = np.asarray(labels, np.float32).reshape(-1)
    if features.ndim != 2 or features.shape != (labels.size, NUM_FEATURES):
        raise ValueError(f"features must be [n, {NUM_FEATURES}] for n labels, got {features.shape} and {labels.size}")
    if labels.size < 20:
        raise ValueError(f"{labels.size} rows are too few to train a stop model: collect on more prompts or tokens")
    if labels.min() < 0 or labels.max() > 1:
        raise ValueError("labels must lie in [0, 1]")
    generator = torch.Generator().manual_seed(seed)
    torch_features, torch_labels = torch.from_numpy(features), torch.from_numpy(labels)
    order = torch.randperm(labels.size, generator=generator)
    heldout_rows = int(labels.size * holdout)
    test, train = order[:heldout_rows], order[heldout_rows:]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = StopModel(hidden)
    optimiser = torch.optim.Adam(model.parameters(), lr=learning_rate)
    loss = torch.nn.BCEWithLogitsLoss()
    for _ in range(epochs):
        for batch in train[torch.randperm(train.numel(), generator=generator)].split(batch_size):
            optimiser.zero_grad()
            loss(model(torch_features[batch]), torch_labels[batch]).backward()
            optimiser.step()
    report = TrainReport(
        rows=int(labels.size),
        positive_rate=float(labels.mean()),
        train_accuracy=_accuracy(model, torch_features[train], torch_labels[train]),
        heldout_rows=heldout_rows,
        heldout_accuracy=_accuracy(model, torch_features[test], torch_labels[test]),
        heldout_log_loss=_log_loss(model.probability(torch_features[test]), torch_labels[test]),
        constant_log_loss=_log_loss(torch_labels[train].mean().expand(len(test)), torch_labels[test]),
        epochs=epochs,
    )
    return model, report


def save_stop_model(directory: str | Path, model: StopModel, pair: PairIdentity, report: TrainReport) -> Path:
    """Write ``directory/stop_model.json`` (a few KB, readable) and return its path."""
    path = Path(directory) / STOP_MODEL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    linear = [layer for layer in model.layers if isinstance(layer, torch.nn.Linear)]
    record = {
        "format": FORMAT,
        "features": FEATURES,
        "pair": dataclasses.asdict(pair),
        "report": dataclasses.asdict(report),
        "hidden": model.hidden,
        "layers": [
            {"weight": np.round(layer.weight.detach().numpy(), 6).tolist(), "bias": layer.bias.detach().tolist()}
            for layer in linear
        ],
    }
    path.write_text(json.dumps(record))
    return path


def load_stop_model(directory: str | Path, pair: PairIdentity | None = None) -> StopModel:
    """The stop model in ``directory``; with ``pair``, refused unless trained for that pair."""
    path = Path(directory) / STOP_MODEL_FILE
    if not path.is_file():
        raise SpecbeamConfigError(f"mcsd: no stop model at {path}; {TRAIN_HINT}")
    try:
        record = json.loads(path.read_text())
        if record.get("format") != FORMAT or record.get("features") != FEATURES:
            raise ValueError(f"format {record.get('format')!r} with features {record.get('features')!r}")
        stored = PairIdentity(**record["pair"])
        model = StopModel(int(record["hidden"]))
        linear = [layer for layer in model.layers if isinstance(layer, torch.nn.Linear)]
        with torch.no_grad():
            for layer, values in zip(linear, record["layers"], strict=True):
                layer.weight.copy_(torch.tensor(values["weight"]))
                layer.bias.copy_(torch.tensor(values["bias"]))
    except (ValueError, KeyError, TypeError, RuntimeError) as error:
        raise SpecbeamConfigError(
            f"mcsd: {path} is not a stop model this version reads ({error}); {TRAIN_HINT}"
        ) from error
    if pair is not None and not stored.matches(pair):
        raise SpecbeamConfigError(
            f"mcsd: the stop model in {directory} was trained for target {stored.target!r} with draft "
            f"{stored.draft!r}; this engine runs target {pair.target!r} with draft {pair.draft!r}. "
            f"Use a stop model of this pair: {TRAIN_HINT}"
        )
    return model.eval()
