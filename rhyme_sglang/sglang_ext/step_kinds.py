"""The decode step kinds RhymeWorker adds around sglang's NGRAM verify path.

:func:`verify_width` runs sglang's verify with ``n`` tree nodes per request by switching the
NGRAM worker's width attributes and the per-batch-size views of its preallocated buffers
(``[bs, n]`` accept buffers and flat masks) for one step; :func:`ragged_verify` lets each
request of that step verify only its first ``lens[i] <= n`` nodes (the forward runs those
rows only); :func:`plain_decode` runs a normal one-token decode inside the speculative
schedule and returns it as a verify result that accepted no draft. All reach into sglang's
NGRAM worker and are fenced here.
"""

from __future__ import annotations

from contextlib import contextmanager


class _WidthViews:
    """``views[bs]``: the first ``bs`` rows of a preallocated buffer at ``n`` nodes per request
    (flat, or ``[bs, n]`` when ``rows``), standing in for the NGRAM worker's per-bs lists."""

    def __init__(self, base, n: int, per_req: int, rows: bool):
        self.base, self.n, self.per_req, self.rows = base, n, per_req, rows

    def __getitem__(self, bs: int):
        flat = self.base.view(-1)[: bs * self.per_req]
        return flat.view(bs, self.n) if self.rows else flat


_WIDTH_ATTRS = ("draft_token_num", "speculative_num_draft_tokens")
# NGRAM worker's per-batch-size view lists -> (buffer, power of n per request, [bs, n] rows)
_VIEWS = {
    "retrieve_indexes_batch": ("retrieve_indexes", 1, True),
    "retrieve_next_token_batch": ("retrieve_next_token", 1, True),
    "retrieve_next_sibling_batch": ("retrieve_next_sibling", 1, True),
    "positions_batch": ("positions", 1, False),
    "draft_tokens_batch": ("draft_tokens", 1, False),
    "tree_mask_batch": ("tree_mask", 2, False),
}


@contextmanager
def verify_width(worker, n: int):
    """Run sglang's NGRAM verify path with ``n`` tree nodes per request (n - 1 drafts):
    its width attributes and the per-batch-size views of its preallocated buffers."""
    if n == worker.draft_token_num:
        yield
        return
    saved = {name: getattr(worker, name) for name in _WIDTH_ATTRS + tuple(_VIEWS)}
    worker.draft_token_num = worker.speculative_num_draft_tokens = n
    for name, (base, power, rows) in _VIEWS.items():
        setattr(worker, name, _WidthViews(getattr(worker, base), n, n ** power, rows))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(worker, name, value)


@contextmanager
def ragged_verify(worker, lens):
    """Run the step's verify forward over each request's first ``lens[i]`` tree nodes only
    (node 0, its last token, and ``lens[i] - 1`` drafts; the tree's other nodes are padding).

    Everything else of sglang's verify keeps its ``[bs, n]`` layout: the KV slots of all
    ``bs * n`` nodes are allocated (the padding's are never written, never accepted, and
    freed with the other rejected ones), the tree links to padding nodes are cut (padding
    nodes come after the real ones, so a link to one is a link to an index ``>= lens[i]``;
    nothing walks to them), and the logits come back as ``[bs * n, vocab]``, the real rows
    copied into a buffer the worker keeps (:func:`padded_logits`): its padding rows hold
    finite values of earlier steps (zeros at first), which no accepted path reads. The CPU
    attention backend reads the ragged lengths from the spec input
    (``cpu_backend/patches.py: ragged_verify_metadata``). ``lens`` None, or every length
    ``n``: sglang's verify as it is."""
    import torch

    n = worker.draft_token_num
    if lens is None or all(length == n for length in lens):
        yield
        return
    target = worker.target_worker
    original = target.forward_batch_generation
    lens_t = torch.tensor(lens, dtype=torch.int64)
    if not bool(((lens_t >= 1) & (lens_t <= n)).all()):
        raise ValueError(f"ragged verify lengths must be in [1, {n}], got {lens}")
    bs = len(lens)
    real = (torch.arange(n).view(1, n) < lens_t.view(-1, 1)).view(-1)
    rows = real.nonzero().view(-1)

    def forward(batch, *args, is_verify=False, **kwargs):
        if not is_verify:
            return original(batch, *args, is_verify=is_verify, **kwargs)
        spec = batch.spec_info
        for links in (spec.retrieve_next_token, spec.retrieve_next_sibling):
            view = links.view(bs, n)
            view.masked_fill_(view >= lens_t.view(-1, 1).to(view.dtype), -1)
        saved = batch.input_ids, batch.out_cache_loc, spec.positions
        batch.input_ids, batch.out_cache_loc = batch.input_ids[rows], batch.out_cache_loc[rows]
        spec.positions = spec.positions[rows]
        spec.rhyme_verify_lens = lens_t.to(torch.int32)
        try:
            out = original(batch, *args, is_verify=True, **kwargs)
        finally:
            batch.input_ids, batch.out_cache_loc, spec.positions = saved
            spec.rhyme_verify_lens = None
        logits = out.logits_output.next_token_logits
        full = padded_logits(worker, bs * n, logits)
        full.index_copy_(0, rows, logits)
        out.logits_output.next_token_logits = full
        return out

    target.forward_batch_generation = forward  # instance attribute, removed below
    try:
        yield
    finally:
        target.__dict__.pop("forward_batch_generation", None)


def padded_logits(worker, rows: int, like):
    """The first ``rows`` rows of a ``[rows, vocab]`` logits buffer the worker keeps across
    ragged verify steps (zeros when made; grown, and remade for another dtype or vocab, as
    needed): a fresh padded tensor each step would zero-fill every padding row, which at a
    large batch and vocabulary costs more than the rows the step really runs. Steps run
    one after another (ragged verifies run on the synchronous scheduler only, and
    a step's logits are read before the next step starts)."""
    import torch

    buffer = getattr(worker, "_rhyme_padded_logits", None)
    vocab = like.shape[-1]
    if (buffer is None or buffer.shape[0] < rows or buffer.shape[1] != vocab
            or buffer.dtype != like.dtype or buffer.device != like.device):
        size = rows if buffer is None else max(rows, buffer.shape[0])
        buffer = torch.zeros((size, vocab), dtype=like.dtype, device=like.device)
        worker._rhyme_padded_logits = buffer
    return buffer[:rows]


def plain_decode(worker, batch, on_publish):
    """A normal one-token decode inside the speculative schedule (same KV layout as a
    verify step that accepted no draft: the last token's KV lands at ``seq_len``)."""
    import torch
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
    from sglang.srt.layers.logprob_processor import compute_spec_logprobs
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    bs, n, device = len(batch.reqs), worker.draft_token_num, worker.device
    seq_lens = batch.seq_lens
    batch.input_ids = torch.tensor([req.output_ids[-1] for req in batch.reqs],
                                   dtype=torch.int64, device=device)
    batch.out_cache_loc = assign_extend_cache_locs_func(
        req_pool_indices=batch.req_pool_indices, req_to_token=batch.req_to_token_pool.req_to_token,
        start_offset=seq_lens, end_offset=seq_lens + 1, batch_size=bs, draft_token_num=1,
        device=device,
    )
    saved = (batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info)
    batch.seq_lens = seq_lens + 1  # plain decode counts the new token in seq_lens
    if batch.seq_lens_cpu is not None:
        batch.seq_lens_cpu = batch.seq_lens_cpu + 1
    batch.seq_lens_sum = (batch.seq_lens_sum or 0) + bs
    batch.spec_info = None
    raw_logits = {}
    runner = worker.target_worker.model_runner
    if batch.return_logprob:
        # sglang's sampler works on the logits in place; keep the raw ones for logprobs
        sample = runner.sample

        def keep_raw_then_sample(logits_output, forward_batch):
            raw_logits["value"] = logits_output.next_token_logits.clone()
            return sample(logits_output, forward_batch)

        runner.sample = keep_raw_then_sample  # instance attribute, removed below
    try:
        out = worker.target_worker.forward_batch_generation(batch)
    finally:
        batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info = saved
        runner.__dict__.pop("sample", None)
    predict = out.next_token_ids
    accept_index = torch.full((bs, n), -1, dtype=torch.int32, device=device)
    accept_index[:, 0] = torch.arange(bs, dtype=torch.int32, device=device)
    if batch.return_logprob:
        out.logits_output.next_token_logits = raw_logits["value"]
        compute_spec_logprobs(batch, out.logits_output, predict, accept_index=accept_index)
    accept_lens = torch.ones(bs, dtype=torch.int32, device=device)
    accept_tokens = torch.zeros(bs, n, dtype=torch.int32, device=device)
    accept_tokens[:, 0] = predict
    accept_tokens = accept_tokens.flatten()
    new_seq_lens = seq_lens + 1
    if on_publish is not None:
        on_publish(new_seq_lens)
    return GenerationBatchResult(
        logits_output=out.logits_output, next_token_ids=accept_tokens,
        can_run_cuda_graph=out.can_run_cuda_graph, accept_lens=accept_lens,
        new_seq_lens=new_seq_lens,
        next_draft_input=NgramVerifyInput(
            draft_token_num=n, new_seq_lens=new_seq_lens, accept_tokens=accept_tokens,
            accept_lens=accept_lens,
        ),
        speculative_num_draft_tokens=worker.speculative_num_draft_tokens,
    )
