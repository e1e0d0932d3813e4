"""A recorded run of gradient norms: its JSON file, the ranks that stand out, a text table."""

from __future__ import annotations

import json
import math
import statistics

VERSION = 1
QUANTITIES = ("activation", "activation_global", "param", "param_global")


class FlowRun:
    """Per-layer gradient norms over steps.

    Each entry of ``steps`` is a dict of lists: ``activation`` and ``param`` are ranks x layers
    (what each rank saw), ``activation_global`` and ``param_global`` are per layer.

    * ``activation``: the norm of the gradient reaching the layer's output on that rank (its rows
      of the batch); ``activation_global``: the norm over every rank's rows, the square root of
      the sum of the ranks' squares.
    * ``param``: the norm of the layer's parameter gradients that rank holds after the
      backward: the reduced gradient (the same on every rank) under DDP, the rank's shard under
      FSDP2; ``param_global``: the norm of the whole reduced gradient. A rank whose data is off
      shows in ``activation``, not here: the engine has averaged it into everyone's gradient.

    Under tensor parallelism a rank's ``activation`` is the gradient it holds: the whole value
    where the output is replicated over the tensor-parallel ranks (the group's ranks show the
    same number), its shard where it is sharded; its ``param`` is its shards (a ``Partial``
    gradient: its own unreduced sum). Under pipelines a rank's rows hold its own stages' layers,
    0 elsewhere. The global norms count each element of the whole gradient once on every
    engine (docs/flow.rst, Engines).
    """

    def __init__(self, layers: list[str], ranks: int, engine: str, steps: list | None = None):
        self.layers, self.ranks, self.engine = list(layers), ranks, engine
        self.steps: list[dict] = steps if steps is not None else []

    def add(self, **quantities) -> dict:
        record = {name: quantities[name] for name in QUANTITIES}
        self.steps.append(record)
        return record

    def series(self, name: str) -> list:
        """``name`` over the steps: steps x layers, or steps x ranks x layers."""
        return [step[name] for step in self.steps]

    # -- the file -------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        with open(path, "w") as f:
            # NaN and Infinity are kept (json writes them as JavaScript does): they are findings
            json.dump(
                {
                    "version": VERSION,
                    "layers": self.layers,
                    "ranks": self.ranks,
                    "engine": self.engine,
                    "steps": self.steps,
                },
                f,
            )

    @classmethod
    def load(cls, path: str) -> FlowRun:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != VERSION:
            raise ValueError(f"{path}: not a distgrad.flow run of version {VERSION}")
        return cls(data["layers"], data["ranks"], data["engine"], data["steps"])

    # -- what stands out ------------------------------------------------------------------------
    def odd_ranks(self, factor: float = 10.0) -> dict[int, str]:
        """The ranks whose activation gradients differ from the other ranks', each with why.

        A rank with a non-finite norm is always named. Otherwise a rank's offset is the median,
        over steps and layers, of its log norm minus the median log norm of all ranks; a rank is
        named where that offset is more than ``factor`` either way. With two ranks the median
        would sit halfway between them, so each is compared with the other instead; both are
        then off by the same factor, and only the one with the larger gradients is named (the
        message says by how much)."""
        if self.ranks < 2 or not self.steps:
            return {}
        found = {}
        offsets = {}
        for rank in range(self.ranks):
            diffs = []
            for step in self.steps:
                for layer in range(len(self.layers)):
                    mine = step["activation"][rank][layer]
                    if not math.isfinite(mine):
                        found[rank] = (
                            f"non-finite activation gradient norm ({mine}) at {self.layers[layer]}"
                        )
                        break
                    # two ranks: the other one; more: all of them (the odd one cannot move it far)
                    others = [
                        step["activation"][r][layer]
                        for r in range(self.ranks)
                        if r != rank or self.ranks > 2
                    ]
                    others = [math.log10(v) for v in others if math.isfinite(v) and v > 0]
                    if mine > 0 and others:
                        diffs.append(math.log10(mine) - statistics.median(others))
            if diffs:
                offsets[rank] = statistics.median(diffs)
        limit = math.log10(factor)
        for rank, offset in offsets.items():
            if rank in found or abs(offset) <= limit or (self.ranks == 2 and offset < 0):
                continue
            word = "larger" if offset > 0 else "smaller"
            found[rank] = (
                f"activation gradients {10 ** abs(offset):.3g}x {word} than the other "
                "ranks' (median over steps and layers)"
            )
        return dict(sorted(found.items()))

    # -- for a terminal -------------------------------------------------------------------------
    def table(self) -> str:
        """The norms of the last step, a layer per row; then the ranks that stand out."""
        if not self.steps:
            return "no steps recorded"
        last, first = self.steps[-1], self.steps[0]
        head = (
            ["layer", "act global", "at step 0"]
            + [f"act r{r}" for r in range(self.ranks)]
            + ["param global"]
        )
        rows = [head]
        for i, layer in enumerate(self.layers):
            rows.append(
                [layer, fmt(last["activation_global"][i]), fmt(first["activation_global"][i])]
                + [fmt(last["activation"][r][i]) for r in range(self.ranks)]
                + [fmt(last["param_global"][i])]
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
        lines = [
            f"gradient norms at the last step ({len(self.steps) - 1}; {self.engine}, "
            f"{self.ranks} rank{'s' if self.ranks > 1 else ''})"
        ]
        lines += [
            "  ".join(
                cell.rjust(w) if c else cell.ljust(w)
                for c, (cell, w) in enumerate(zip(row, widths))
            )
            for row in rows
        ]
        odd = self.odd_ranks()
        lines += [f"odd rank {rank}: {why}" for rank, why in odd.items()] or ["no odd rank"]
        return "\n".join(lines)


def fmt(value: float) -> str:
    return f"{value:.3e}" if math.isfinite(value) else str(value)
