"""Translate an engine-independent :class:`~rhyme_sglang.core.Draft` into sglang's verify tree.

sglang's NGRAM verify input has ``n`` nodes per request: node 0 is the last verified token
and ``mask[i, j]`` marks ``j`` as an ancestor-or-self of ``i``. A draft's node ``k`` becomes
node ``k + 1``; its parent ``-1`` becomes node 0. Unused slots are padded as extra children
of node 0 carrying an already-present token, which the verifier may accept only if the
target model itself produces that token (so padding never changes the output).
"""

from __future__ import annotations

import numpy as np


def draft_to_tree(last_token: int, token_ids, parents, n: int):
    """Return ``(tokens [n] int64, mask [n, n] bool, num_real)``; at most ``n - 1`` draft nodes."""
    if n < 1:
        raise ValueError(f"draft tree width must be >= 1, got {n}")
    m = min(len(token_ids), n - 1)
    tokens = np.empty(n, dtype=np.int64)
    mask = np.zeros((n, n), dtype=bool)
    tokens[0] = last_token
    mask[0, 0] = True
    for k in range(m):
        node, parent = k + 1, parents[k] + 1
        if not 0 <= parent < node:
            raise ValueError(f"draft parent {parents[k]} of node {k} is not before it")
        tokens[node] = token_ids[k]
        mask[node] = mask[parent]
        mask[node, node] = True
    pad = tokens[1] if m > 0 and parents[0] == -1 else last_token
    for node in range(m + 1, n):
        tokens[node] = pad
        mask[node, 0] = True
        mask[node, node] = True
    return tokens, mask, m
