"""PNG plots of post-training runs, from their metrics.jsonl (the Agg backend is chosen by openk3.train.plots).

    plot_rl("runs/pt/rl/coding-low")      # -> plots/rl.png: reward and success, reasoning length, truncated and
                                          #    budget-penalised fractions, staleness, KL to the initial policy
    plot_report(report, "runs/pt/report.png")   # teachers vs the distilled student per domain and effort
"""

from __future__ import annotations

from pathlib import Path

from openk3.train.plots import plt, read_metrics


def plot_rl(run_dir: str | Path) -> Path:
    """One line per (domain, effort) found in the rows, so a merged metrics file of several policies works too."""
    rows = [r for r in read_metrics(run_dir) if "reward" in r]
    out = Path(run_dir) / "plots"
    out.mkdir(exist_ok=True)
    panels = [("reward", "reward"), ("success", "success rate"), ("reasoning_tokens", "reasoning tokens"),
              ("budget_penalised", "fraction budget-penalised"), ("truncated", "fraction truncated"),
              ("staleness", "staleness (policy versions)"), ("kl_to_init", "KL to the initial policy")]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    keys = sorted({(r["domain"], r["effort"]) for r in rows})
    for ax, (key, label) in zip(axes.flat, panels):
        for domain, effort in keys:
            mine = [r for r in rows if (r["domain"], r["effort"]) == (domain, effort)]
            ax.plot([r["step"] for r in mine], [r[key] for r in mine], "o-", label=f"{domain}/{effort}")
        ax.set_title(label)
        ax.set_xlabel("iteration")
    axes.flat[0].legend(fontsize=7)
    axes.flat[-1].axis("off")
    fig.tight_layout()
    path = out / "rl.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_report(report: dict, path: str | Path) -> Path:
    """Bars of success and mean reasoning tokens per (domain, effort): SFT start, teacher, distilled student."""
    combos = list(report["results"])
    models = [m for m in ("sft", "teacher", "student") if all(m in report["results"][c] for c in combos)]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4))
    width = 0.8 / max(len(models), 1)
    for ax, key, label in ((axes[0], "success", "success rate"), (axes[1], "reasoning_tokens", "reasoning tokens")):
        for i, m in enumerate(models):
            ax.bar([j + i * width for j in range(len(combos))], [report["results"][c][m][key] for c in combos],
                   width, label=m)
        ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(combos))], combos, rotation=45,
                      fontsize=7)
        ax.set_title(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return Path(path)
