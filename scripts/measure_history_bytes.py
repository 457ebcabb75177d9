"""Bytes per stored token of RHYME history, as it crosses the network on a Ray cluster: a
``DraftStore`` snapshot (``rhyme_snapshot``: what the driver pulls and a restarted engine gets
back), a pickled ``transfer.response_state`` (what ``pool.forward_full_responses`` sends), and the
store's memory estimate. Two workloads of 32 prompts x G=16 x 1,000 tokens: tokens drawn i.i.d.
from a 151k vocabulary (no overlap within a group: the worst case) and ``bench_store``'s groups
(responses share all but 1% of their tokens).

    python scripts/measure_history_bytes.py
"""

from __future__ import annotations

import os
import pickle
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(rollouts) -> tuple:
    """(tokens, snapshot B/token, pickled B/token, memory B/token) of one store of ``rollouts``."""
    from rhyme_sglang.core import DraftStore
    from rhyme_sglang.core.transfer import response_state

    store, tokens, pickled, samples = DraftStore(), 0, 0, {}
    for pid, prompt, resp in rollouts:
        samples[pid] = samples.get(pid, -1) + 1
        state = response_state(pid, [int(t) for t in prompt], [int(t) for t in resp],
                               samples[pid], 0.0)
        pickled += len(pickle.dumps(state, protocol=5))
        store.import_prompt(state)
        tokens += len(resp)
    fd, path = tempfile.mkstemp(suffix=".rhyme")
    os.close(fd)
    try:
        store.save(path)
        size = os.path.getsize(path)
    finally:
        os.unlink(path)
    return tokens, size / tokens, pickled / tokens, store.estimate_memory() / tokens


def main() -> int:
    from benchmarks.bench_store import make_rollouts

    rng = random.Random(0)
    iid = []
    for p in range(32):
        prompt = [rng.randrange(151_000) for _ in range(64)]
        iid += [(f"p{p}", prompt, [rng.randrange(151_000) for _ in range(1000)]) for _ in range(16)]
    for name, rollouts in (("i.i.d. tokens", iid),
                           ("bench_store groups", make_rollouts(512, 1000, 16, 0.01, 0))):
        tokens, snap, sent, mem = measure(rollouts)
        print(f"{name}: {tokens} tokens, snapshot {snap:.2f} B/token, forwarded (pickled) "
              f"{sent:.2f} B/token, memory {mem:.0f} B/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
