"""``runs/<name>/report.md`` with matplotlib plots (reward, tau, rollout time, engine timeline).

Epochs are not compared with each other as speedups: epoch 0 pays the engines' warm-up and
response lengths change as the policy learns. The RHYME-vs-vanilla ratio comes from the
side-by-side of the final policy (``side_by_side.json``, written by ``make demo``), which the
report shows in its own section when the file exists.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List

from rl_driver.metrics import read_metrics

logger = logging.getLogger(__name__)

SIDE_BY_SIDE = "side_by_side.json"


def _epoch_axis(ax) -> None:
    """An x axis of epochs: labelled "epoch", ticks on whole epochs only."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _plot_series(path: Path, epochs, series: Dict[str, List[float]], ylabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for label, ys in series.items():
        ax.plot(epochs, ys, marker="o", label=label)
    _epoch_axis(ax)
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
    _epoch_axis(ax)
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


def decode_kinds(breakdown: Dict[str, Any]) -> List[Dict[str, Any]]:
    """An engine breakdown's decode step kinds, most seconds first: ``kind``, ``steps``,
    ``seconds``, and per step the mean ``step_s``, ``batch`` (requests), ``rows`` (forward rows
    in: a plain step's batch, a verify's tree nodes) and ``tokens`` (emitted); a kind with no
    steps divides by 1."""
    out = []
    for kind, v in sorted(breakdown["decode"].items(), key=lambda kv: -kv[1]["seconds"]):
        n = v["steps"] or 1
        out.append({"kind": kind, "steps": v["steps"], "seconds": v["seconds"],
                    "step_s": v["seconds"] / n, "batch": v["requests"] / n,
                    "rows": v.get("rows", 0) / n, "tokens": v["tokens"] / n})
    return out


def other_seconds(breakdown: Dict[str, Any]) -> float:
    """An engine's seconds outside forwards while requests were in flight: result processing
    plus scheduling (idle time not included)."""
    return breakdown["postprocess_s"] + breakdown["schedule_s"]


def decode_steps(breakdown: Dict[str, Any]) -> int:
    """An engine's decode steps, summed over step kinds."""
    return sum(v["steps"] for v in breakdown["decode"].values())


def save_side_by_side(run_dir: Path, result: Dict[str, Any]) -> Path:
    """Write a :func:`rl_driver.side_by_side.compare` result to ``run_dir/side_by_side.json``
    without the engines' ``output_ids`` (every response's tokens: bulky, not reported)."""
    def slim(v):
        return {k: x for k, x in v.items() if k != "output_ids"} if isinstance(v, dict) else v

    path = Path(run_dir) / SIDE_BY_SIDE
    path.write_text(json.dumps({k: slim(v) for k, v in result.items()}, indent=1))
    return path


def _epoch_table(metrics: List[Dict[str, Any]]) -> List[str]:
    """Per-epoch (per-step in a run of steps) figures, each on its own (no ratio to another)."""
    lines = ["| epoch | reward | rollout s | tok/s | tau | mean len | bubble | migrations | "
             "train s | sync s |", "|---" * 10 + "|"]
    for m in metrics:
        label = f"{m['epoch']} (step {m['step']})" if "step" in m else m["epoch"]
        lines.append(f"| {label} | {m['mean_reward']:.3f} | {m['rollout_makespan_s']:.1f} | "
                     f"{m['tokens_per_s']:.0f} | {m['tau']:.2f} | {m['mean_response_len']:.1f} | "
                     f"{m['bubble_ratio']:.2f} | {m['migrations']} | {m['train_time_s']:.1f} | "
                     f"{m['sync_time_s']:.1f} |")
    return lines


def _breakdown_table(metrics: List[Dict[str, Any]]) -> List[str]:
    """Engine-seconds per part of each epoch's rollout (:func:`breakdown_parts`)."""
    names = sorted({k for m in metrics for k in breakdown_parts(m)})
    lines = ["Rollout time breakdown (engine-seconds, summed over engines):", "",
             "| epoch | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for m in metrics:
        parts = breakdown_parts(m)
        lines.append(f"| {m['epoch']} | " + " | ".join(f"{parts.get(n, 0.0):.1f}" for n in names)
                     + " |")
    return lines + ["", "![breakdown](breakdown.png)", ""]


def _engine_breakdown(label: str, breakdown: Dict[str, Any]) -> List[str]:
    """One side-by-side engine's prefill and other seconds, then a row per decode step kind."""
    if not breakdown:
        return [f"**{label}**: no breakdown", ""]
    lines = [f"**{label}**: prefill {breakdown['prefill']['seconds']:.1f} s, other "
             f"{other_seconds(breakdown):.1f} s (result processing + scheduling), decode:", "",
             "| step kind | steps | seconds | s a step | mean batch | rows in a step | "
             "tokens out a step |", "|---" * 7 + "|"]
    for f in decode_kinds(breakdown):
        lines.append(f"| {f['kind']} | {f['steps']} | {f['seconds']:.1f} | {f['step_s']:.3f} | "
                     f"{f['batch']:.1f} | {f['rows']:.1f} | {f['tokens']:.1f} |")
    return lines + [""]


def _saved_steps(v: Dict[str, Any], h: Dict[str, Any]) -> str:
    """Decode steps RHYME saved: vanilla's minus RHYME's, each summed over step kinds (negative
    when RHYME ran more)."""
    if not (v.get("breakdown") and h.get("breakdown")):
        return "Decode steps saved by RHYME: unknown (no breakdown)."
    nv, nh = decode_steps(v["breakdown"]), decode_steps(h["breakdown"])
    return (f"Decode steps saved by RHYME: {nv - nh} (vanilla {nv}, RHYME {nh}, each summed "
            f"over step kinds).")


def _side_by_side_section(run_dir: Path) -> List[str]:
    """The final policy's vanilla-vs-RHYME rollout from ``run_dir/side_by_side.json``; no lines
    when the file does not exist."""
    path = run_dir / SIDE_BY_SIDE
    if not path.exists():
        return []
    r = json.loads(path.read_text())
    v, h = r["vanilla"], r["rhyme"]
    how = {True: " (both engines at once)",
           False: " (one after the other)"}.get(r.get("concurrent"), "")
    lines = ["## Side by side: vanilla SGLang vs RHYME (final policy)", "",
             "One rollout of every prompt x group with the final policy, same engine "
             f"settings{how}.",
             "", "| engine | makespan s | tok/s | tau |", "|---|---|---|---|"]
    for label, e in (("vanilla SGLang", v), ("RHYME", h)):
        lines.append(f"| {label} | {e['makespan_s']:.1f} | {e['tokens_per_s']:.0f} | "
                     f"{e['tau']:.2f} |")
    lines += ["", f"RHYME vs vanilla: x{r['speedup_tokens_per_s']:.2f} tok/s, "
              f"x{r['speedup_makespan']:.2f} makespan; same tokens for "
              f"{100 * r['same_tokens']:.0f}% of requests (seeded draws).", "",
              _saved_steps(v, h), ""]
    lines += _engine_breakdown("vanilla SGLang", v.get("breakdown"))
    return lines + _engine_breakdown("RHYME", h.get("breakdown"))


def write_report(run_dir: Path, title: str = "") -> Path:
    """Plots + a markdown table of the per-epoch metrics in ``run_dir/metrics.jsonl``, the
    rollout time breakdown when epochs have one, and the side-by-side section when
    ``run_dir/side_by_side.json`` exists."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    if not metrics:
        raise ValueError(f"{run_dir}/metrics.jsonl has no epochs to report")
    epochs = [m.get("step", m["epoch"]) for m in metrics]  # a run of steps: one point a step
    _plot_series(run_dir / "reward.png", epochs, {"mean reward": [m["mean_reward"] for m in metrics]},
                 "mean reward", "Reward")
    _plot_series(run_dir / "tau.png", epochs, {"tau": [m["tau"] for m in metrics]},
                 "accepted tokens / verify step", "Speculation (tau)")
    _plot_series(run_dir / "rollout_time.png", epochs,
                 {"rollout makespan (s)": [m["rollout_makespan_s"] for m in metrics],
                  "train (s)": [m["train_time_s"] for m in metrics]}, "seconds", "Time per epoch")
    _plot_timeline(run_dir / "timeline.png", metrics)
    has_breakdown = _plot_breakdown(run_dir / "breakdown.png", metrics)
    lines = [f"# {title or run_dir.name}", ""] + _epoch_table(metrics)
    lines += ["", "Predicted load imbalance (makespan / mean engine load) of the assignment used "
              "vs round-robin, per epoch: " + ", ".join(
                  f"{m['predicted_imbalance']:.3f}/{m['predicted_imbalance_round_robin']:.3f}"
                  for m in metrics), "",
              "![reward](reward.png) ![tau](tau.png)", "",
              "![rollout time](rollout_time.png)", "", "![timeline](timeline.png)", ""]
    if has_breakdown:
        lines += _breakdown_table(metrics)
    lines += _side_by_side_section(run_dir)
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    logger.info("report written to %s", path)
    return path


def run_title(name: str) -> str:
    """The title of a run's report."""
    return f"rhyme-rl run '{name}'"
