"""One PNG of a run: layer x step heatmaps of the global norms, a layer x rank heatmap of the
activation gradients, log colour scales. matplotlib (the ``flow`` extra) is imported here only,
when a picture is drawn."""

from __future__ import annotations

import math

from .flow_run import FlowRun


def grid(rows: list[list[float]]):
    """A masked array for a log colour scale: zeros and non-finite values left blank."""
    import numpy as np

    values = np.array(rows, dtype=float)
    return np.ma.masked_where(~np.isfinite(values) | (values <= 0), values)


def draw(run: FlowRun, path: str) -> None:
    """Write the picture of ``run`` to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    if not run.steps:
        raise ValueError("distgrad.flow: no steps recorded, nothing to draw")
    layers = [".".join(name.split(".")[-2:]) for name in run.layers]  # h.0: short enough to read
    acts = [list(col) for col in zip(*run.series("activation_global"))]  # layers x steps
    params = [list(col) for col in zip(*run.series("param_global"))]
    per_rank = [
        [median_over_steps(run, rank, layer) for rank in range(run.ranks)]
        for layer in range(len(run.layers))
    ]  # layers x ranks
    panels = [
        (acts, "activation gradient, global", "step"),
        (params, "parameter gradient, global", "step"),
        (per_rank, "activation gradient per rank\n(median over steps)", "rank"),
    ]
    fig, axes = plt.subplots(
        1,
        3,
        figsize=(11, 0.9 + 0.32 * max(len(layers), 4)),
        gridspec_kw={"width_ratios": [3, 3, max(run.ranks, 2)]},
    )
    for ax, (values, title, xlabel) in zip(axes, panels):
        data = grid(values)
        ok = data.compressed()
        norm = LogNorm(vmin=ok.min(), vmax=ok.max()) if ok.size and ok.min() < ok.max() else None
        cmap = plt.get_cmap("viridis").copy()
        cmap.set_bad("#d62728")  # zero or non-finite: red, not a colour of the scale
        image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
        fig.colorbar(image, ax=ax, fraction=0.08, pad=0.02).ax.tick_params(
            labelsize=7, which="both"
        )
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_yticks(
            range(len(layers)), layers if ax is axes[0] else [""] * len(layers), fontsize=7
        )
        ax.tick_params(axis="x", labelsize=7)
        if xlabel == "rank":
            ax.set_xticks(range(run.ranks))
    odd = run.odd_ranks()
    said = "; ".join(f"odd rank {rank}: {why}" for rank, why in odd.items()) or "no odd rank"
    fig.suptitle(
        f"gradient norms: {len(run.steps)} steps, {run.ranks} ranks ({run.engine}). {said}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def median_over_steps(run: FlowRun, rank: int, layer: int) -> float:
    values = sorted(step["activation"][rank][layer] for step in run.steps)
    if any(not math.isfinite(v) for v in values):
        return math.nan
    return values[len(values) // 2]
