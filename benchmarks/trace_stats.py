"""Per-epoch statistics of a rollout trace: reward, response lengths and reusable tokens.

The reuse statistic is the one of ``benchmarks/data/README.md``: a response token counts as
reusable when its ``n``-token context plus the token itself (``n`` = 4) appears in the previous
epoch's responses to the same prompt. Lengths report mean, median, max, the max / median tail
ratio and how many responses hit the length cap (``finish_reason == "length"``).

    python -m benchmarks.trace_stats TRACE.jsonl.gz [--context 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from typing import Dict, Iterable, List, Sequence, Set, Tuple

from benchmarks.common import write_json


def grams(responses: Iterable[Sequence[int]], n: int) -> Set[Tuple[int, ...]]:
    """Every (n-token context, token) window of the responses."""
    out: Set[Tuple[int, ...]] = set()
    for ids in responses:
        out.update(tuple(ids[i - n:i + 1]) for i in range(n, len(ids)))
    return out


def reusable(ids: Sequence[int], seen: Set[Tuple[int, ...]], n: int) -> Tuple[int, int]:
    """(tokens whose context + token is in ``seen``, tokens with a full context)."""
    hits = sum(tuple(ids[i - n:i + 1]) in seen for i in range(n, len(ids)))
    return hits, max(0, len(ids) - n)


def epoch_stats(records, context: int = 4) -> List[Dict]:
    """One row per epoch: responses, mean reward, length figures, reuse vs the epoch before."""
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    by_epoch: Dict[int, List] = defaultdict(list)
    for r in records:
        by_epoch[r.epoch].append(r)
    rows = []
    for epoch in sorted(by_epoch):
        recs = by_epoch[epoch]
        lengths = [len(r.response_token_ids) for r in recs]
        median = statistics.median(lengths)
        row = {"epoch": epoch, "responses": len(recs),
               "mean_reward": statistics.mean(r.reward for r in recs),
               "mean_length": statistics.mean(lengths), "median_length": median,
               "max_length": max(lengths), "tail_ratio": max(lengths) / median if median else None,
               "capped": sum(r.finish_reason == "length" for r in recs), "reuse": None}
        previous = by_epoch.get(epoch - 1)
        if previous:
            history: Dict[str, List] = defaultdict(list)
            for r in previous:
                history[r.prompt_id].append(r.response_token_ids)
            seen = {pid: grams(resps, context) for pid, resps in history.items()}
            hits = total = 0
            for r in recs:
                h, t = reusable(r.response_token_ids, seen.get(r.prompt_id, set()), context)
                hits, total = hits + h, total + t
            row["reuse"] = hits / total if total else None
        rows.append(row)
    return rows


def format_table(rows: List[Dict]) -> str:
    head = "| epoch | responses | mean reward | mean len | median | max | max/median | capped | reuse |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        reuse = "-" if r["reuse"] is None else f"{r['reuse']:.2f}"
        tail = "-" if r["tail_ratio"] is None else f"{r['tail_ratio']:.1f}"
        lines.append(f"| {r['epoch']} | {r['responses']} | {r['mean_reward']:.3f} | "
                     f"{r['mean_length']:.0f} | {r['median_length']:.0f} | {r['max_length']} | "
                     f"{tail} | {r['capped']} | {reuse} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from rhyme_sglang.core import read_trace

    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace_stats")
    parser.add_argument("trace")
    parser.add_argument("--context", type=int, default=4, help="context tokens of the reuse test")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = epoch_stats(read_trace(args.trace), args.context)
    print(format_table(rows))
    write_json(args.json, {"trace": args.trace, "context": args.context, "epochs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
