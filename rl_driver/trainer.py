"""``Trainer``: a Ray actor holding a transformers causal LM and doing the GRPO update.

``train_step(samples)`` takes responses with their rollout logprobs and GRPO advantages and
runs ``num_minibatches`` AdamW steps (gradient accumulation over micro-batches, token-mean
loss, gradient clipping) with the clipped-ratio loss of :mod:`rl_driver.grpo` and an optional
KL to a frozen reference copy. Weight export helpers serve :mod:`rl_driver.weight_sync`.
``train_progress()`` reports ``(micro-batches done, total)`` of the step in flight (the actor
runs with two threads so the driver can poll it while ``train_step`` runs).

Prompt sharing (``share_prompt_forward``, default on): GRPO samples G responses per prompt, so
a micro-batch runs each distinct prompt once, gathers its KV (still in the autograd graph) for
every response row, and runs the responses on top: the same logprobs and gradients as a
forward of prompt + response per sample, with the prompt computed once per group.

Threads: ``num_threads`` 0 = every usable core; ``autocast_bf16: auto`` = on only where the
engines (``engine_dtype``) run bf16 and the machine computes it natively
(:func:`rl_driver.config.trainer_autocast`), so trainer and rollout logprobs share a format.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rl_driver.config import TrainConfig, trainer_autocast
from rl_driver.grpo import LossConfig, grpo_loss, token_logprobs

logger = logging.getLogger(__name__)


def _pad(seqs: Sequence[Sequence[int]], pad: int, left: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(list(s), dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def pack_rows(prompt_of: Sequence[int], lengths: Sequence[int], width: int) -> List[Tuple[int, List[Tuple[int, int]]]]:
    """Responses packed into rows of ``width`` tokens, only responses of one prompt per row
    (they share its KV): first fit, longest first, prompt by prompt. Returns ``[(prompt,
    [(sample, first column), ...]), ...]``; every sample is in exactly one row."""
    if any(n < 1 or n > width for n in lengths):
        raise ValueError(f"response lengths must be in 1..{width}, got {list(lengths)}")
    rows: List[Tuple[int, List[Tuple[int, int]]]] = []
    free: List[int] = []
    open_rows: Dict[int, List[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: (prompt_of[i], -lengths[i], i)):
        k, n = prompt_of[i], lengths[i]
        r = next((r for r in open_rows.get(k, []) if free[r] >= n), None)
        if r is None:
            r = len(rows)
            rows.append((k, []))
            free.append(width)
            open_rows.setdefault(k, []).append(r)
        rows[r][1].append((i, width - free[r]))
        free[r] -= n
    return rows


def _packed_layout(responses: Sequence[Sequence[int]], prompt_of: Sequence[int], width: int,
                   pad: int):
    """The rows of :func:`pack_rows` as tensors: each row's prompt ``[R]``, token ids ``[R, W]``,
    the self-attention mask among them ``[R, W, W]`` (same response, causal), each token's index
    in its response ``[R, W]`` and, per response, the flat index into ``[R, W - 1]`` of the
    column predicting each of its tokens after the first ``[B, W - 1]`` (-1 past its end)."""
    lengths = [len(r) for r in responses]
    rows = pack_rows(prompt_of, lengths, width)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    seg = torch.full((len(rows), width), -1, dtype=torch.long)  # the response of each column
    offset = torch.zeros((len(rows), width), dtype=torch.long)
    gather = torch.full((len(responses), max(width - 1, 0)), -1, dtype=torch.long)
    for r, (_, members) in enumerate(rows):
        for i, col in members:
            n = lengths[i]
            ids[r, col:col + n] = torch.tensor(list(responses[i]), dtype=torch.long)
            seg[r, col:col + n] = i
            offset[r, col:col + n] = torch.arange(n)
            gather[i, :n - 1] = r * (width - 1) + col + torch.arange(n - 1)
    same = (seg.unsqueeze(2) == seg.unsqueeze(1)) & (seg.unsqueeze(2) >= 0)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    row_prompt = torch.tensor([k for k, _ in rows], dtype=torch.long)
    return row_prompt, ids, same & causal, offset, gather


class Trainer:
    """Policy model + optimizer. ``samples`` are dicts with ``prompt_ids``, ``response_ids``,
    ``logprobs`` (rollout, one per response token) and ``advantage``."""

    def __init__(self, model_path: str, config: TrainConfig, seed: int = 0,
                 engine_dtype: str = "auto"):
        """``engine_dtype``: what the rollout engines were asked to run (``autocast_bf16: auto``
        follows them; a resolved :class:`RunConfig` has made it true or false already)."""
        from transformers import AutoModelForCausalLM

        from rhyme_sglang.machine import choose_trainer_threads, usable_cores

        self.num_threads = choose_trainer_threads(config.num_threads, usable_cores())
        torch.set_num_threads(self.num_threads)
        torch.manual_seed(seed)
        self.config = config
        self.autocast = (config.autocast_bf16 if isinstance(config.autocast_bf16, bool)
                         else trainer_autocast(engine_dtype))
        self._progress = (0, 0)
        self.model_path = model_path
        dtype = getattr(torch, config.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.model.config.use_cache = False
        self.model.train()
        self.ref_model = None
        if config.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay)
        self.loss_config = LossConfig(config.clip_eps_low, config.clip_eps_high, config.kl_coef)
        self.version = 0
        self.pad_id = 0

    def ready(self) -> int:
        return self.version

    def train_progress(self) -> Tuple[int, int]:
        """(micro-batches done, micro-batches in total) of the current or last ``train_step``."""
        return self._progress

    # ---- GRPO ------------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast)

    def _full_logprobs(self, model, batch: List[Dict[str, Any]]) -> torch.Tensor:
        """Logprobs of each response token, one forward of prompt + response per sample: rows
        are left-padded so every response ends at the last column; returned left-aligned
        (``[B, width]``, response token j at column j)."""
        width = max(len(s["response_ids"]) for s in batch)
        ids, mask = _pad([list(s["prompt_ids"]) + list(s["response_ids"]) for s in batch],
                         self.pad_id, left=True)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with self._autocast():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                           logits_to_keep=width + 1).logits
        right = token_logprobs(logits[:, :-1], ids[:, -width:])
        out = torch.zeros_like(right)
        for i, s in enumerate(batch):
            n = len(s["response_ids"])
            out[i, :n] = right[i, width - n:]
        return out

    def _shared_logprobs(self, model, batch: List[Dict[str, Any]]) -> torch.Tensor:
        """The same logprobs as :meth:`_full_logprobs` with one forward per distinct prompt and
        little padding: the prompts' KV (left-padded, kept in the autograd graph) is gathered
        per row, and each row packs responses of one prompt side by side (:func:`pack_rows`),
        each attending to its prompt and causally to itself only (a 4-D mask). A group of G
        samples computes its prompt once and its gradient sums the G responses' parts."""
        index: Dict[Tuple[int, ...], int] = {}
        prompt_of = [index.setdefault(tuple(s["prompt_ids"]), len(index)) for s in batch]
        width = max(len(s["response_ids"]) for s in batch)
        p_ids, p_mask = _pad(list(index), self.pad_id, left=True)
        row_prompt, r_ids, self_mask, offset, gather = _packed_layout(
            [s["response_ids"] for s in batch], prompt_of, width, self.pad_id)
        # padding columns attend to their row's prompt: no all-masked row (NaN gradients)
        mask = torch.cat([p_mask.bool()[row_prompt].unsqueeze(1).expand(-1, width, -1),
                          self_mask], dim=-1).unsqueeze(1)
        start = p_mask.sum(-1)[row_prompt].unsqueeze(1)  # the first response position
        with self._autocast():
            prompt = model(input_ids=p_ids, attention_mask=p_mask, use_cache=True,
                           position_ids=(p_mask.cumsum(-1) - 1).clamp(min=0), logits_to_keep=1)
            cache = prompt.past_key_values
            cache.reorder_cache(row_prompt)  # index_select: differentiable
            logits = model(input_ids=r_ids, past_key_values=cache, use_cache=True,
                           attention_mask=mask, position_ids=start + offset).logits
        # token 0 of a sample is predicted by its prompt's last position, token j by column j-1
        first = token_logprobs(prompt.logits[prompt_of, -1:],
                               torch.tensor([[s["response_ids"][0]] for s in batch]))
        if width == 1:
            return first
        following = token_logprobs(logits[:, :-1], r_ids[:, 1:]).reshape(-1)
        rest = torch.where(gather >= 0, following[gather.clamp(min=0)], torch.zeros(()))
        return torch.cat([first, rest], dim=1)

    def _response_logprobs(self, model, batch: List[Dict[str, Any]]) -> torch.Tensor:
        if self.config.share_prompt_forward:
            return self._shared_logprobs(model, batch)
        return self._full_logprobs(model, batch)

    @staticmethod
    def _targets(batch: List[Dict[str, Any]]):
        """Left-aligned rollout logprobs, response mask and advantages of a micro-batch."""
        width = max(len(s["response_ids"]) for s in batch)
        old, resp_mask = torch.zeros(len(batch), width), torch.zeros(len(batch), width)
        for i, s in enumerate(batch):
            n = len(s["response_ids"])
            if len(s["logprobs"]) != n:
                raise ValueError(f"sample {i}: {len(s['logprobs'])} logprobs for {n} tokens")
            old[i, :n] = torch.tensor(s["logprobs"], dtype=torch.float32)
            resp_mask[i, :n] = 1.0
        adv = torch.tensor([float(s["advantage"]) for s in batch], dtype=torch.float32)
        return old, resp_mask, adv

    def _micro_batches(self, samples: List[Dict[str, Any]]) -> List[List[Dict[str, Any]]]:
        """``samples`` cut into micro-batches of at most ``micro_batch_size`` samples and
        ``micro_batch_tokens`` padded response tokens (rows x longest response; one sample
        always fits), ordered so each pads little: by total length, or (prompt sharing) group
        by group, so a prompt group shares one micro-batch where it fits. The loss does not
        depend on this order."""
        if self.config.share_prompt_forward:
            groups: Dict[Tuple[int, ...], List[Dict[str, Any]]] = {}
            for s in samples:
                groups.setdefault(tuple(s["prompt_ids"]), []).append(s)
            ordered = [s for key in sorted(groups, key=lambda k: (len(k), k))
                       for s in sorted(groups[key], key=lambda s: len(s["response_ids"]))]
        else:
            ordered = sorted(samples, key=lambda s: len(s["prompt_ids"]) + len(s["response_ids"]))
        size, budget = self.config.micro_batch_size, self.config.micro_batch_tokens
        batches: List[List[Dict[str, Any]]] = []
        for s in ordered:
            cur = batches[-1] if batches else None
            longest = max([len(x["response_ids"]) for x in cur or []] + [len(s["response_ids"])])
            if cur is None or len(cur) >= size or (budget and longest * (len(cur) + 1) > budget):
                batches.append([s])
            else:
                cur.append(s)
        return batches

    def _recompute_logprobs(self, samples: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """The samples, in their order, with ``logprobs`` replaced by this model's (no grad);
        the rollout's are kept as ``rollout_logprobs``."""
        fresh = {}
        with torch.no_grad():
            for batch in self._micro_batches(samples):
                logp = self._response_logprobs(self.model, batch)
                for i, s in enumerate(batch):
                    n = len(s["response_ids"])
                    fresh[id(s)] = dict(s, rollout_logprobs=s["logprobs"],
                                        logprobs=logp[i, :n].tolist())
        return [fresh[id(s)] for s in samples]

    def train_step(self, samples: List[Dict[str, Any]]) -> Dict[str, float]:
        """GRPO update on ``samples`` (responses with no tokens are skipped)."""
        t0 = time.time()
        torch.set_num_threads(self.num_threads)  # OpenMP's count is per thread; actor threads vary
        cfg = self.config
        samples = [s for s in samples if len(s["response_ids"]) > 0]
        if not samples:
            raise ValueError("train_step got no samples with response tokens")
        # which samples need a forward: with no KL term, a zero advantage means a zero loss
        # and gradient (they still count in each minibatch's token-mean below)
        skip = cfg.skip_zero_advantage and self.ref_model is None
        needed = [not skip or float(s["advantage"]) != 0.0 for s in samples]
        rollout_diff = None
        if cfg.old_logprobs == "recompute":
            fresh = iter(self._recompute_logprobs([s for s, n in zip(samples, needed) if n]))
            samples = [next(fresh) if n else s for s, n in zip(samples, needed)]
            rollout_diff = sum(abs(a - b) for s in samples if "rollout_logprobs" in s
                               for a, b in zip(s["logprobs"], s["rollout_logprobs"]))
        n = cfg.num_minibatches
        parts = [(samples[i::n], needed[i::n]) for i in range(n) if samples[i::n]]
        minibatches = [m for m, _ in parts]
        kept = [[s for s, k in zip(m, ks) if k] for m, ks in parts]
        plan = [self._micro_batches(k) for k in kept]
        done, total = 0, sum(len(p) for p in plan)
        self._progress = (done, total)
        totals = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "ratio_mean": 0.0,
                  "grad_norm": 0.0, "logprob_abs_diff": 0.0}
        steps = 0
        trained_tokens = 0
        for mb, kept_mb, batches in zip(minibatches, kept, plan):
            num_tokens = float(sum(len(s["response_ids"]) for s in mb))
            # per-token stats are reported over the tokens that had a forward
            trained = sum(len(s["response_ids"]) for s in kept_mb)
            trained_tokens += trained
            self.optimizer.zero_grad(set_to_none=True)
            if not batches:  # every sample skipped: AdamW steps on a zero gradient, as it would
                for p in self.model.parameters():
                    p.grad = torch.zeros_like(p)
            for batch in batches:
                old, resp_mask, adv = self._targets(batch)
                logp = self._response_logprobs(self.model, batch)
                ref = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref = self._response_logprobs(self.ref_model, batch)
                loss, stats = grpo_loss(logp, old, adv, resp_mask, self.loss_config, ref, num_tokens)
                loss.backward()
                totals["loss"] += float(loss.detach())  # each part is already divided by num_tokens
                for k in ("clip_frac", "kl", "ratio_mean"):
                    totals[k] += stats[k] * num_tokens / trained
                totals["logprob_abs_diff"] += float(((logp.detach() - old).abs() * resp_mask).sum())
                done += 1
                self._progress = (done, total)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            totals["grad_norm"] += float(grad_norm)
            steps += 1
        self.version += 1
        all_tokens = sum(len(s["response_ids"]) for s in samples)
        out = {k: v / steps for k, v in totals.items() if k not in ("logprob_abs_diff",)}
        if rollout_diff is not None:  # engine vs trainer, before the update
            totals["logprob_abs_diff"] = rollout_diff
        out.update(logprob_abs_diff=totals["logprob_abs_diff"] / max(1, trained_tokens),
                   optimizer_steps=steps, train_tokens=all_tokens,
                   forward_tokens=trained_tokens, skipped_samples=needed.count(False),
                   train_time_s=time.time() - t0, version=self.version)
        return out

    # ---- weights out -----------------------------------------------------------------------
    def named_tensors(self, dtype: Optional[str] = None) -> List[Tuple[str, torch.Tensor]]:
        cast = getattr(torch, dtype) if dtype else None
        return [(n, p.detach().to(cast) if cast else p.detach().clone())
                for n, p in self.model.named_parameters()]

    def weight_buckets(self, bucket_mb: float, dtype: Optional[str] = None):
        """Parameters grouped into buckets of about ``bucket_mb`` MiB each."""
        limit = bucket_mb * 2 ** 20
        buckets, current, size = [], [], 0
        for name, t in self.named_tensors(dtype):
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > limit:
                buckets.append(current)
                current, size = [], 0
            current.append((name, t))
            size += nbytes
        if current:
            buckets.append(current)
        return buckets

    def put_weight_buckets(self, bucket_mb: float, dtype: Optional[str] = None) -> list:
        """:meth:`weight_buckets` put in Ray's object store by this actor (as
        :func:`rl_driver.weight_sync.to_bucket` arrays); returns their refs."""
        import ray

        from rl_driver.weight_sync import to_bucket

        return [ray.put(to_bucket(b)) for b in self.weight_buckets(bucket_mb, dtype)]

    def weight_meta(self, dtype: Optional[str] = None) -> List[Tuple[str, str, List[int]]]:
        return [(n, (dtype or str(p.dtype).replace("torch.", "")), list(p.shape))
                for n, p in self.model.named_parameters()]

    def node(self) -> Dict[str, Any]:
        """Where this trainer runs: node id, IP, pid, GPU ids and ``CUDA_VISIBLE_DEVICES``."""
        from rl_driver.placement import node_info

        return node_info()

    def rendezvous(self) -> Tuple[str, int]:
        """This node's IP and a free port on it: the weight group's master address."""
        import ray

        from rl_driver.weight_sync import free_port

        return ray.util.get_node_ip_address(), free_port("")

    def write_marker(self, path: str) -> str:
        """Create ``path`` (and its folder) on this node: the shared-folder check."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as fh:
            fh.write("rhyme shared-folder check\n")
        return path

    def init_process_group(self, master_address: str, master_port: int, world_size: int,
                           group_name: str, backend: str) -> bool:
        from rl_driver.weight_sync import new_process_group

        self._group = new_process_group(backend, master_address, master_port, world_size,
                                        rank=0, group_name=group_name)
        return True

    def broadcast_weights(self, dtype: Optional[str] = None) -> int:
        """Rank 0 of the weight group: broadcast every parameter in ``named_parameters`` order."""
        n = 0
        for _, t in self.named_tensors(dtype):
            torch.distributed.broadcast(t.contiguous(), src=0, group=self._group)
            n += 1
        return n

    def save_pretrained(self, path: str, dtype: Optional[str] = None) -> str:
        model = self.model
        if dtype and getattr(torch, dtype) != next(model.parameters()).dtype:
            model = copy.deepcopy(model).to(getattr(torch, dtype))
        model.save_pretrained(path)
        return path

    # ---- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> str:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp"
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "version": self.version, "rng": torch.get_rng_state()}, tmp)
        os.replace(tmp, path)
        return path

    def load_checkpoint(self, path: str) -> int:
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        torch.set_rng_state(state["rng"])
        return self.version
