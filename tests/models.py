"""Small models several test files share."""

from __future__ import annotations

import torch
from torch import nn


class Branchy(nn.Module):
    """Not a chain: two branches meet in a product (planned as a module graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(32, 64), nn.Tanh())
        self.a = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(self.a(h) * self.b(h))


class Skip(nn.Module):
    """Not a chain (the stem's output skips across the blocks): the module-graph path."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(6)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        skip = h
        for block in self.blocks:
            h = block(h)
        return self.head(h + skip)


class Recurrent(nn.Module):
    """An embedding, a 2-layer LSTM and a head: a recurrent model (the graph path)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, 32)
        self.rnn = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(ids))
        return self.head(out[:, -1])
