"""What tests/dist/intervention_job.py and its case groups share: the interventions (a
steering vector, a low-rank ReFT-style module), the batches and how their rows lie on the ranks,
and the relative error parameters are compared by (fp32, 1e-5: REL)."""

from __future__ import annotations

import torch

SCALE, ROWS, STEPS, LR, REL = 1e-3, 2, 3, 0.1, 1e-5
D, R = 64, 4  # GPT-2's width, the low-rank intervention's rank


class LowRank(torch.nn.Module):
    """ReFT's LoReFT edit, h + R^T (W h + b - R h): its own module, not the model's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.rotate = torch.nn.Parameter(torch.randn(R, D) * 0.1)
        self.learned = torch.nn.Linear(D, R)

    def forward(self, h):
        return h + (self.learned(h) - h @ self.rotate.T) @ self.rotate


def interventions():
    torch.manual_seed(11)
    return torch.nn.Parameter(torch.randn(D) * 0.01), LowRank()


def batches(world: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 384, (ROWS * world, 8), generator=g) for _ in range(steps)]


def mine(ids, rank):
    return ids[rank * ROWS : (rank + 1) * ROWS]


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
