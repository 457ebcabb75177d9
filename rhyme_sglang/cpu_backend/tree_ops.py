"""Speculative-tree ops for sglang's CPU path: tree-mask reconstruction and greedy verify.

Tree layout (sglang's): ``n = draft_token_num`` nodes per request, node 0 is the last
verified token, ``tree_mask[b, i, j]`` marks ``j`` an ancestor-or-self of ``i``;
``retrieve_next_token`` is the first child, ``retrieve_next_sibling`` the next sibling.
"""

from __future__ import annotations

import torch


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrieve_index,
                                       retrieve_next_token, retrieve_next_sibling, batch_size,
                                       draft_token_num):
    """Fill positions / retrieve_* in place from the flat ``bs * n * n`` bool tree mask."""
    n = draft_token_num
    if batch_size == 0:
        return
    mask = tree_mask.view(-1)[: batch_size * n * n].view(batch_size, n, n).bool()
    order = torch.arange(n)
    strict = mask & (order.view(1, 1, n) < order.view(1, n, 1))  # [b, i, j]: j < i ancestor
    depth = strict.sum(-1)  # number of strict ancestors
    positions.view(-1)[: batch_size * n] = (
        depth + verified_seq_len.view(-1, 1).to(depth.dtype)
    ).view(-1).to(positions.dtype)
    retrieve_index.view(batch_size, n)[:] = (
        torch.arange(batch_size).view(-1, 1) * n + order.view(1, -1)
    ).to(retrieve_index.dtype)
    parent = torch.where(
        strict.any(-1), (strict * order.view(1, 1, n)).argmax(-1), torch.full_like(depth, -1)
    )
    next_token = torch.full((batch_size, n), -1, dtype=torch.long)
    next_sibling = torch.full((batch_size, n), -1, dtype=torch.long)
    parent_l = parent.tolist()
    for b in range(batch_size):
        first_child = {}
        last_seen = {}
        for i in range(n):
            p = parent_l[b][i]
            if p < 0:
                continue
            if p not in first_child:
                first_child[p] = i
            else:
                next_sibling[b, last_seen[p]] = i
            last_seen[p] = i
        for p, c in first_child.items():
            next_token[b, p] = c
    retrieve_next_token.view(batch_size, n)[:] = next_token.to(retrieve_next_token.dtype)
    retrieve_next_sibling.view(batch_size, n)[:] = next_sibling.to(retrieve_next_sibling.dtype)


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """Walk each request's tree, accepting the child equal to the target argmax."""
    bs, num_spec = accept_index.shape
    cand = candidates.tolist()
    r_index = retrive_index.tolist()
    r_next = retrive_next_token.tolist()
    r_sib = retrive_next_sibling.tolist()
    target = target_predict.view(bs, -1).tolist()
    n = len(cand[0]) if bs else 0
    for b in range(bs):
        last = r_index[b][0]
        accept_index[b, 0] = last
        num_accepted = 0
        cur = 0
        for j in range(1, num_spec):
            cur = r_next[b][cur]
            want = target[last // n][last % n]
            while cur != -1 and cand[b][cur] != want:
                cur = r_sib[b][cur]
            if cur == -1:
                break
            predicts[last] = want
            num_accepted += 1
            accept_index[b, num_accepted] = r_index[b][cur]
            last = r_index[b][cur]
        accept_token_num[b] = num_accepted
        predicts[last] = target[last // n][last % n]
