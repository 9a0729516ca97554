"""PNG plots of a training run, drawn from its metrics.jsonl (the format is documented in trainer.py).

    plot_run("runs/tiny-...")   # -> plots/loss.png, plots/expert_load.png, plots/attnres.png

matplotlib runs with the Agg backend (files only, no display needed).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def plot_run(run_dir: str | Path) -> list[Path]:
    """Draw every plot the run's metrics allow into run_dir/plots; returns the files written."""
    records = read_metrics(run_dir)
    out = Path(run_dir) / "plots"
    out.mkdir(exist_ok=True)
    written = [plot_loss(records, out / "loss.png")]
    last = records[-1] if records else {}
    if last.get("expert_load"):
        written.append(plot_expert_load(last, out / "expert_load.png"))
    attnres = next((r["attnres"] for r in reversed(records) if r.get("attnres")), None)
    if attnres:
        written.append(plot_attnres(attnres, last["step"], out / "attnres.png"))
    return written


def plot_loss(records: list[dict], path: Path) -> Path:
    """Training loss against step, validation loss where it was measured."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train")
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_expert_load(record: dict, path: Path) -> Path:
    """Heat map of each MoE layer's expert loads (load / mean load) at one logged step."""
    layers = list(record["expert_load"])
    load_LE = np.array([record["expert_load"][i] for i in layers])
    fig, ax = plt.subplots(figsize=(max(5, 0.25 * load_LE.shape[1] + 2), max(2.5, 0.4 * load_LE.shape[0] + 1.5)))
    im = ax.imshow(load_LE, cmap="viridis", aspect="auto", vmin=0)
    fig.colorbar(im, ax=ax, label="load / mean load")
    ax.set_yticks(range(len(layers)), layers)
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(f"expert load at step {record['step']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_attnres(attnres: dict, step: int, path: Path) -> Path:
    """Block AttnRes: the mean weight each mixing point (rows: layer.attn, layer.mlp, output) puts on each source
    (columns: 0 = embedding, then the completed blocks; the last entry of a row is its block's partial sum)."""
    names = list(attnres)
    width = max(len(w) for w in attnres.values())
    w_RS = np.full((len(names), width), np.nan)
    for i, name in enumerate(names):
        w_RS[i, :len(attnres[name])] = attnres[name]
    fig, ax = plt.subplots(figsize=(max(4, 0.6 * width + 2.5), max(3, 0.3 * len(names) + 1.5)))
    im = ax.imshow(w_RS, cmap="magma", aspect="auto", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax, label="mean mixing weight")
    ax.set_yticks(range(len(names)), names)
    ax.set_xticks(range(width))
    ax.set_xlabel("source (0 = embedding, then blocks;\nlast of a row = partial block)")
    ax.set_title(f"AttnRes depth weights at step {step}")
    fig.tight_layout()
    # NOTE: tight_layout only moves the axes; a label wider than a small figure (few blocks) is still cut at the
    # figure's edge. bbox_inches="tight" grows the saved image to hold every label.
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
