"""Small PyTorch models for export tests and demos: a CNN, a transformer encoder layer, a GRU, an LSTM.

Each factory builds its model with seeded weights (without touching the global RNG) in eval mode.
Example use: `accel-opt build examples/tiny_models.py:cnn --shapes image:2x3x32x32`.
Suggested shapes are in SHAPES.
"""

from __future__ import annotations

import torch
from torch import nn

SHAPES = {
    "cnn": {"image": [2, 3, 32, 32]},
    "transformer": {"tokens": [2, 16, 32]},
    "gru": {"sequence": [2, 10, 8]},
    "lstm": {"sequence": [2, 10, 8]},
}


def _seeded(build, seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


class TinyCNN(nn.Module):
    """Conv-BN-ReLU x2, global average pool, linear classifier: (N, 3, H, W) -> (N, classes)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        )
        self.head = nn.Linear(32, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(image).mean(dim=(2, 3)))


class TinyTransformer(nn.Module):
    """One pre-norm encoder layer (self-attention + MLP): (N, T, 32) -> (N, T, 32)."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True, norm_first=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layer(tokens)


class TinyGRU(nn.Module):
    """Two-layer GRU, classifier on the last step: (N, T, 8) -> (N, 4)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, sequence: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(sequence)
        return self.head(out[:, -1])


class TinyLSTM(nn.Module):
    """LSTM returning two outputs: logits (N, 4) and the final hidden state (layers, N, 16)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, sequence: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, (hidden, _) = self.rnn(sequence)
        return self.head(out[:, -1]), hidden


def cnn() -> nn.Module:
    model = _seeded(TinyCNN)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):  # non-trivial batch-norm statistics
        torch.manual_seed(1)
        for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 1.5)
    return model


def transformer() -> nn.Module:
    return _seeded(TinyTransformer)


def gru() -> nn.Module:
    return _seeded(TinyGRU)


def lstm() -> nn.Module:
    return _seeded(TinyLSTM)


# Export hints (ModuleFactory.export_hints): variable sequence length, named outputs.
transformer.dynamic = {"tokens": {1: "sequence"}}
gru.dynamic = {"sequence": {1: "steps"}}
lstm.dynamic = {"sequence": {1: "steps"}}
lstm.output_names = ["logits", "hidden"]
