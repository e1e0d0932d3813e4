"""One process, plain PyTorch: the module is its own wrapper."""

from __future__ import annotations

import torch

from .base import Engine


class LocalEngine(Engine):
    name = "local"

    @property
    def model(self) -> torch.nn.Module:
        return self.wrapped

    def forward(self, args, kwargs):
        return self.wrapped(*args, **kwargs)
