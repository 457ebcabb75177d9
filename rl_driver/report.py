"""``runs/<name>/report.md`` with matplotlib plots (reward, tau, rollout time, engine timeline)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List

from rl_driver.metrics import read_metrics

logger = logging.getLogger(__name__)


def _plot_series(path: Path, epochs, series: Dict[str, List[float]], ylabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for label, ys in series.items():
        ax.plot(epochs, ys, marker="o", label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_timeline(path: Path, metrics: List[Dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rl_driver.balance import merge_intervals

    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.5 * max(1, len(metrics))))
    offset, ticks, labels = 0.0, [], []
    for row, m in enumerate(metrics):
        timeline = m.get("timeline", {})
        n = max([int(e) for e in timeline] + [len(m.get("engine_busy_s", [])) - 1, 0]) + 1
        for e in range(n):
            y = row * (n + 1) + e
            segs = merge_intervals([tuple(iv) for iv in timeline.get(str(e), [])])
            ax.broken_barh([(s, t - s) for s, t in segs], (y - 0.4, 0.8), color=f"C{e}")
            ticks.append(y)
            labels.append(f"ep{m['epoch']} e{e}")
        offset = max(offset, m.get("rollout_makespan_s", 0.0))
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("seconds since rollout start (bars: engine busy)")
    ax.set_title("Engine utilisation per rollout")
    ax.set_xlim(0, offset * 1.02 if offset else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def breakdown_parts(m: Dict[str, Any]) -> Dict[str, float]:
    """Seconds per part of an epoch's rollout, summed over engines: prefill, decode steps by
    kind (draft lookups shown apart), result processing, scheduling, idle."""
    parts: Dict[str, float] = {}
    for b in m.get("breakdown", []):
        parts["prefill"] = parts.get("prefill", 0.0) + b["prefill"]["seconds"]
        parts["draft lookup"] = parts.get("draft lookup", 0.0) + b.get("draft_s", 0.0)
        for kind, v in b["decode"].items():
            parts[kind] = parts.get(kind, 0.0) + v["seconds"]
        for key, name in (("postprocess_s", "result processing"), ("schedule_s", "scheduling"),
                          ("idle_s", "idle")):
            parts[name] = parts.get(name, 0.0) + b.get(key, 0.0)
    draft = parts.pop("draft lookup", 0.0)
    decode_total = sum(v for k, v in parts.items() if k == "plain" or k.startswith("verify"))
    if decode_total > 0 and draft > 0:  # draft lookups run inside decode steps
        for k in list(parts):
            if k == "plain" or k.startswith("verify"):
                parts[k] -= draft * parts[k] / decode_total
        parts["draft lookup"] = draft
    return parts


def _plot_breakdown(path: Path, metrics: List[Dict[str, Any]]) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(m["epoch"], breakdown_parts(m)) for m in metrics if m.get("breakdown")]
    if not rows:
        return False
    names = sorted({k for _, p in rows for k in p})
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    bottom = [0.0] * len(rows)
    for i, name in enumerate(names):
        vals = [p.get(name, 0.0) for _, p in rows]
        ax.bar([e for e, _ in rows], vals, bottom=bottom, label=name, color=f"C{i % 10}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("epoch")
    ax.set_ylabel("engine-seconds")
    ax.set_title("Where rollout time goes (all engines)")
    ax.legend(fontsize=6)
    last = [m for m in metrics if m.get("breakdown")][-1]
    for e, b in enumerate(last["breakdown"]):
        pts = b.get("batch_over_time", [])
        ax2.step([t for t, _ in pts], [n for _, n in pts], where="post", label=f"engine {e}")
    ax2.set_xlabel("seconds since the engine's rollout start")
    ax2.set_ylabel("running batch")
    ax2.set_title(f"Running batch over time (epoch {last['epoch']})")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(run_dir: Path, title: str = "") -> Path:
    """Plots + a markdown table of the per-epoch metrics in ``run_dir/metrics.jsonl``."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    if not metrics:
        raise ValueError(f"{run_dir}/metrics.jsonl has no epochs to report")
    epochs = [m["epoch"] for m in metrics]
    base = metrics[0]
    _plot_series(run_dir / "reward.png", epochs, {"mean reward": [m["mean_reward"] for m in metrics]},
                 "mean reward", "Reward")
    _plot_series(run_dir / "tau.png", epochs, {"tau": [m["tau"] for m in metrics]},
                 "accepted tokens / verify step", "Speculation (tau)")
    _plot_series(run_dir / "rollout_time.png", epochs,
                 {"rollout makespan (s)": [m["rollout_makespan_s"] for m in metrics],
                  "train (s)": [m["train_time_s"] for m in metrics]}, "seconds", "Time per epoch")
    _plot_timeline(run_dir / "timeline.png", metrics)
    has_breakdown = _plot_breakdown(run_dir / "breakdown.png", metrics)
    lines = [f"# {title or run_dir.name}", "",
             "| epoch | reward | rollout s | tok/s | speedup (tok/s vs ep0) | tau | mean len | "
             "bubble | migrations | train s | sync s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in metrics:
        speedup = m["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
        lines.append(f"| {m['epoch']} | {m['mean_reward']:.3f} | {m['rollout_makespan_s']:.1f} | "
                     f"{m['tokens_per_s']:.0f} | {speedup:.2f}x | {m['tau']:.2f} | "
                     f"{m['mean_response_len']:.1f} | {m['bubble_ratio']:.2f} | {m['migrations']} | "
                     f"{m['train_time_s']:.1f} | {m['sync_time_s']:.1f} |")
    lines += ["", "Predicted load imbalance (makespan / mean engine load) of the assignment used "
              "vs round-robin, per epoch: " + ", ".join(
                  f"{m['predicted_imbalance']:.3f}/{m['predicted_imbalance_round_robin']:.3f}"
                  for m in metrics), "",
              "![reward](reward.png) ![tau](tau.png)", "",
              "![rollout time](rollout_time.png)", "", "![timeline](timeline.png)", ""]
    if has_breakdown:
        lines += ["Rollout time breakdown (engine-seconds, summed over engines):", "",
                  "| epoch | " + " | ".join(sorted({k for m in metrics for k in breakdown_parts(m)}))
                  + " |"]
        names = sorted({k for m in metrics for k in breakdown_parts(m)})
        lines.append("|---" * (len(names) + 1) + "|")
        for m in metrics:
            parts = breakdown_parts(m)
            lines.append(f"| {m['epoch']} | " + " | ".join(f"{parts.get(n, 0.0):.1f}" for n in names)
                         + " |")
        lines += ["", "![breakdown](breakdown.png)", ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    logger.info("report written to %s", path)
    return path
