"""History for SGLang's NGRAM peer: seed its n-gram trie with earlier responses.

An NGRAM engine learns its corpus online: after each decode step its worker inserts the last
``speculative_ngram_max_trie_depth`` tokens of every running request (prompt tail + output)
into a trie, every suffix of that window a path. An engine that served epochs 0..e-1 of an RL
run therefore holds those epochs' n-grams when epoch e starts. :func:`seed` gives a fresh NGRAM
engine the same knowledge from a trace, without generating it: for every response it inserts
the window that ends at each of its tokens (a superset of the windows the online path inserts
at step ends, so the seeded engine knows at least what a long-lived one would). The trie keeps
its own capacity and LRU eviction.

The worker is captured by an AFTER hook on ``NGRAMWorker.__init__`` (registered by the plugin
in every process; a no-op outside the scheduler), and ``ngram_seed`` is served on the control
socket of engines without RHYME (:mod:`.timeline`). From the main process:
``rhyme_sglang.Engine.ngram_seed([(prompt_ids, response_ids), ...])``.
"""

from __future__ import annotations

from typing import Iterable

_WORKER: list = []  # the NGRAM worker of this scheduler process, once built


def capture_hook(result, worker, *args, **kwargs):
    """AFTER ``NGRAMWorker.__init__``: remember the worker (one per scheduler process)."""
    _WORKER[:] = [worker]
    return result


def windows(tokens: list, prompt_len: int, depth: int) -> list:
    """The windows of at most ``depth`` tokens that end at each token of the response
    ``tokens[prompt_len:]``, as the online path inserts them."""
    if depth < 2:
        raise ValueError(f"depth must be >= 2, got {depth!r}")
    return [tokens[max(0, end - depth):end] for end in range(prompt_len + 1, len(tokens) + 1)]


def _check_sequences(sequences) -> list:
    if not isinstance(sequences, list):
        raise ValueError(f"sequences must be a list of {{'prompt', 'response'}} objects, got "
                         f"{type(sequences).__name__}")
    out = []
    for i, item in enumerate(sequences):
        if not isinstance(item, dict) or set(item) != {"prompt", "response"}:
            raise ValueError(f"sequences[{i}] must be an object with exactly 'prompt' and "
                             f"'response' (token id lists), got {item!r:.80}")
        ids = []
        for key in ("prompt", "response"):
            part = item[key]
            if not isinstance(part, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in part):
                raise ValueError(f"sequences[{i}].{key} must be a list of token ids (ints >= 0)")
            ids.append(part)
        out.append(ids)
    return out


def seed(sequences) -> dict:
    """Insert ``[{"prompt": [ids], "response": [ids]}, ...]`` into this process's NGRAM trie;
    returns ``{"sequences", "windows", "tokens"}``. Waits until the trie holds them."""
    if not _WORKER:
        raise ValueError("this engine has no NGRAM worker ('ngram_seed' needs "
                         "speculative_algorithm='NGRAM')")
    checked = _check_sequences(sequences)
    worker = _WORKER[0]
    depth = int(worker.max_trie_depth)
    batch = []
    for prompt, response in checked:
        batch.extend(windows(prompt + response, len(prompt), depth))
    if batch:
        worker.ngram_corpus.batch_put(batch)
        worker.ngram_corpus.synchronize()
    return {"sequences": len(checked), "windows": len(batch),
            "tokens": sum(len(r) for _, r in checked)}


def as_payload(pairs: Iterable) -> list:
    """``[(prompt_ids, response_ids), ...]`` -> the JSON-safe list :func:`seed` takes."""
    out = []
    for i, pair in enumerate(pairs):
        if isinstance(pair, (str, bytes, dict)) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise ValueError(f"ngram_seed takes (prompt_ids, response_ids) pairs; item {i} is "
                             f"{pair!r:.80}")
        out.append({"prompt": list(pair[0]), "response": list(pair[1])})
    return out
