"""DraftStore: the request-lifecycle API over per-prompt, live and global suffix tries."""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import asdict
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

from . import weights as W
from .branching import RewardFit
from .config import StoreConfig, WindowConfig
from .combine import mix_draft_py
from .draft import Draft
from .history import (ActiveRequest, PromptHistory, ResponseRecord, check_tokens, prompt_key,
                      tail_of)
from .lengths import LengthStats
from .native import make_trie, native_module, resolve_backend
from .persist import read_snapshot, write_snapshot
from .transfer import parse_prompt_state, prompt_state
from .upkeep import HistoryUpkeep
from .window import SpecWindow

logger = logging.getLogger(__name__)
RewardTarget = Union[str, Tuple[str, int]]


class DraftStore(HistoryUpkeep):
    """History-drafted speculation store (engine-agnostic; see the package docstring for use).

    Drafts come from three tries, each matched on the longest suffix of the request's context
    (prompt tail + generated tokens): the prompt's history (finished responses of earlier epochs
    and finished siblings), the prompt's live trie (its prompt text and in-flight responses), and a
    global trie over every prompt's history. Their drafts are mixed into one tree (see
    `StoreConfig`). `speculate` changes only the request's last-draft bookkeeping (and applies
    pending reward re-weighting of closed epochs); it is always safe to call and never raises for
    a known request with a valid budget. Not thread-safe: one caller (the scheduler) at a time.
    """

    def __init__(self, config: Optional[StoreConfig] = None, backend: str = "auto") -> None:
        self.backend = resolve_backend(backend)
        self._mix = native_module().mix_draft if self.backend == "native" else mix_draft_py
        self._reset(config or StoreConfig())

    def _reset(self, config: StoreConfig) -> None:
        """An empty store with `config` (the backend stays)."""
        self.config = config
        self.epoch = 0
        self.epoch_origin = 0
        self.lengths = LengthStats(config.default_length)
        self._prompts: "OrderedDict[str, PromptHistory]" = OrderedDict()
        self._global = self._new_trie(config.global_depth)
        self._requests: Dict[str, ActiveRequest] = {}
        self._finished: Dict[str, ResponseRecord] = {}
        self._dirty_open: Set[Tuple[str, int]] = set()
        self._dirty_closed: Set[Tuple[str, int]] = set()
        self._num_tokens = 0
        self._num_records = 0
        self._pending_global: List[ResponseRecord] = []
        self._residue: "OrderedDict[str, List[ResponseRecord]]" = OrderedDict()
        self._residue_records = 0
        self._residue_tokens = 0
        self._trie_bytes = self._global.estimate_memory()
        self.reward_coef = config.reward_weight
        self._reward_fit = RewardFit(self.reward_coef) if config.reward_rule == "online" else None

    # ----------------------------------------------------------------- lifecycle
    def start_request(self, request_id: str, prompt_token_ids: Sequence[int],
                      prompt_id: Optional[str] = None, sample: Optional[int] = None, *,
                      run_ahead: bool = False) -> str:
        """Begin tracking a request; returns the prompt key. Duplicate ids raise ValueError.
        A `run_ahead` request's response joins the history as a draft-only record (see
        `finish_request`)."""
        if not isinstance(run_ahead, bool):
            raise ValueError(f"run_ahead must be a bool, got {run_ahead!r}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already started")
        if sample is not None and (not isinstance(sample, int) or sample < 0):
            raise ValueError(f"sample must be an int >= 0, got {sample!r}")
        prompt = check_tokens(prompt_token_ids, "prompt_token_ids")
        key = prompt_key(prompt, prompt_id)
        ph = self._touch(key, prompt)
        req = ActiveRequest(request_id, key, sample, self.epoch, len(ph.prompt_tail),
                            array("i", ph.prompt_tail), SpecWindow(self.config.window),
                            run_ahead=run_ahead)
        if self.config.use_live:
            if ph.live is None:
                ph.live = self._new_trie()
                ph.live_prompt = prompt[-self.config.live_prompt_tokens:] \
                    if self.config.live_prompt_tokens else array("i")
                ph.live.insert(ph.live_prompt, W.WEIGHT_SCALE)
            # the request's sequence grows as a stream: the native trie keeps it path-compressed
            req.stream = ph.live.open_stream(req.seq, W.WEIGHT_SCALE)
        ph.num_active += 1
        self._requests[request_id] = req
        return key

    def add_tokens(self, request_id: str, tokens: Sequence[int]) -> None:
        """Append generated tokens; in-flight siblings see them through the live trie."""
        req = self._request(request_id)
        new = check_tokens(tokens, "tokens")
        if not new:
            return
        old = len(req.seq)
        req.seq.extend(new)
        ph = self._prompts[req.key]
        if ph.live is not None:
            ph.live.extend(req.seq, old, W.WEIGHT_SCALE, req.stream)

    def finish_request(self, request_id: str, reward: Optional[float] = None, *,
                       add_to_history: bool = True,
                       truncated: bool = False) -> Optional[ResponseRecord]:
        """Stop a request; its response joins the prompt's history unless `add_to_history` is
        False (e.g. replay in history mode adds a whole epoch at once). A run-ahead request's
        response joins as a draft-only record (`reward` is ignored), in the run-ahead sample
        space: its own sample, or the next free one when that is held; unless it is empty, or
        `truncated` (aborted) with fewer than `StoreConfig.run_ahead_min_tokens` tokens."""
        req = self._request(request_id)
        if req.run_ahead:
            reward = None
        else:
            reward = W.check_reward(reward) if reward is not None else req.reward
        del self._requests[request_id]
        ph = self._prompts[req.key]
        if ph.live is not None:
            ph.live.remove(req.seq, W.WEIGHT_SCALE)
            ph.live.close_stream(req.stream)
        ph.num_active -= 1
        if ph.num_active == 0:
            ph.live, ph.live_prompt = None, None
        response = req.seq[req.prefix_len:]
        short = len(response) < (self.config.run_ahead_min_tokens if truncated else 1)
        if not add_to_history or self._too_old(req.epoch) or (req.run_ahead and short):
            self._drop_if_empty(ph)  # a prompt without history or requests is not kept
            return None
        ahead = req.run_ahead
        sample = req.sample if req.sample is not None else ph.next_sample(req.epoch, ahead)
        if ph.find(req.epoch, sample, ahead) is not None:
            sample = ph.next_sample(req.epoch, ahead)
        rec = self._add_record(ph, response, req.epoch, sample, reward, request_id, ahead)
        self._enforce_budget()
        return rec

    def add_response(self, prompt_id: Optional[str], prompt_token_ids: Sequence[int],
                     response_token_ids: Sequence[int], epoch: int,
                     reward: Optional[float] = None,
                     sample: Optional[int] = None, *,
                     run_ahead: bool = False) -> Optional[ResponseRecord]:
        """Add a whole finished response (replay, trace loading). Returns its record, or None
        when `epoch` is already outside the kept history window. `run_ahead`: a draft-only
        record (no reward: `reward` must be None), in the run-ahead sample space."""
        if not isinstance(run_ahead, bool):
            raise ValueError(f"run_ahead must be a bool, got {run_ahead!r}")
        if run_ahead and reward is not None:
            raise ValueError(f"a run-ahead response takes no reward, got {reward!r}")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if sample is not None and (not isinstance(sample, int) or sample < 0):
            raise ValueError(f"sample must be an int >= 0, got {sample!r}")
        reward = W.check_reward(reward)
        prompt = check_tokens(prompt_token_ids, "prompt_token_ids")
        response = check_tokens(response_token_ids, "response_token_ids")
        key = prompt_key(prompt, prompt_id)
        if self._too_old(epoch):
            return None
        ph = self._touch(key, prompt)
        if sample is None:
            sample = ph.next_sample(epoch, run_ahead)
        elif ph.find(epoch, sample, run_ahead) is not None:
            kind = "run-ahead response" if run_ahead else "response"
            raise ValueError(f"prompt {key!r} already has a {kind} for epoch {epoch} sample {sample}")
        rec = self._add_record(ph, response, epoch, sample, reward, None, run_ahead)
        self._enforce_budget()
        return rec

    def set_reward(self, target: RewardTarget, reward: float) -> None:
        """Attach a reward to a finished request id, an active one (applied when it finishes), or
        `(prompt_id, sample)` (the newest epoch holding that sample). Run-ahead requests and
        records take no reward: a request id of one is unknown here, and `(prompt_id, sample)`
        names the real response."""
        reward = W.check_reward(reward)
        if reward is None:
            raise ValueError("reward must be a finite number, got None")
        if isinstance(target, str):
            if target in self._requests:
                if self._requests[target].run_ahead:
                    raise ValueError(f"request {target!r} is a run-ahead request: it takes no reward")
                self._requests[target].reward = reward
                return
            rec = self._finished.get(target)
            if rec is None:
                raise ValueError(f"unknown request id {target!r}")
        elif isinstance(target, tuple) and len(target) == 2:
            key, sample = target
            ph = self._prompts.get(key)
            rec = ph.latest_with_sample(sample) if ph is not None else None
            if rec is None:
                raise ValueError(f"no stored response for prompt {key!r} sample {sample!r}")
        else:
            raise ValueError(f"reward target must be a request id or (prompt_id, sample), got {target!r}")
        rec.reward = reward
        self._mark_dirty(rec.key, rec.epoch)

    def has_reward_target(self, target: RewardTarget) -> bool:
        """Whether `set_reward(target, r)` would find its response (check before a batch)."""
        if isinstance(target, str):
            req = self._requests.get(target)
            return (req is not None and not req.run_ahead) or target in self._finished
        if isinstance(target, tuple) and len(target) == 2:
            ph = self._prompts.get(target[0])
            return ph is not None and ph.latest_with_sample(target[1]) is not None
        return False

    def advance_epoch(self) -> int:
        """Close the current epoch: finalize reward weights, apply the history window."""
        if self._reward_fit is not None:
            self._refit_reward()
        self.epoch += 1
        self._dirty_closed |= {g for g in self._dirty_open if g[1] < self.epoch}
        self._dirty_open = {g for g in self._dirty_open if g[1] >= self.epoch}
        if self.config.history_epochs is not None:
            for key in list(self._prompts):
                ph = self._prompts[key]
                for epoch in sorted(ph.records):
                    if self._too_old(epoch):
                        self._evict_epoch(ph, epoch)
                self._drop_if_empty(ph)
            self._age_residue()
        if W.needs_rebase(self.epoch, self.epoch_origin, self.config.epoch_decay):
            self._rebase()
        self._flush()
        pending, self._pending_global = self._pending_global, []
        for rec in pending:
            if rec.epoch < self.epoch:
                self._to_global(rec)
            elif rec.alive:
                self._pending_global.append(rec)
        return self.epoch

    # ----------------------------------------------------------------- drafting
    def speculate(self, request_id: str, max_tokens: int, *, min_prob: Optional[float] = None,
                  max_branch: Optional[int] = None) -> Draft:
        """Draft at most min(max_tokens, window) tokens for the request's next positions."""
        req = self._request(request_id)
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        cfg = self.config
        min_prob = cfg.min_prob if min_prob is None else min_prob
        max_branch = cfg.max_branch if max_branch is None else max_branch
        if not 0.0 <= min_prob <= 1.0 or max_branch < 1:
            raise ValueError(f"need 0 <= min_prob <= 1 and max_branch >= 1, got {min_prob}, {max_branch}")
        if self._needs_flush:
            self._flush()
        budget = min(max_tokens, req.window.size)
        best = Draft()
        if budget > 0:
            tail = req.seq[-cfg.max_pattern:]
            ph = self._prompts[req.key]
            glob = self._global if cfg.use_global else None
            pat = cfg.max_pattern
            sources = (("prompt", ph.tree, 1.0, pat), ("live", ph.live, cfg.live_weight, pat),
                       ("global", glob, cfg.global_penalty, pat))
            if cfg.combine == "mix":
                best = self._mixed(tail, sources, budget, min_prob, max_branch)
            else:
                best = self._best(tail, sources, budget, min_prob, max_branch)
        req.last_draft = best
        return best

    def _best(self, tail, sources, budget, min_prob, max_branch) -> Draft:
        cfg, best, best_score = self.config, Draft(), 0.0
        for name, tree, scale, pat in sources:
            if tree is None or scale <= 0:
                continue
            toks, parents, probs, score, mlen = tree.draft(tail, pat, budget, min_prob,
                                                           max_branch, cfg.prior, cfg.prior_decay)
            if toks and score * scale > best_score:
                best_score = score * scale
                best = Draft(list(toks), list(parents), list(probs), score, mlen, name)
        return best

    def _mixed(self, tail, sources, budget, min_prob, max_branch) -> Draft:
        cfg = self.config
        tries = [t for _, t, _, _ in sources]
        weights = [w for _, _, w, _ in sources]
        toks, parents, probs, score, mlen, used = self._mix(
            tries, weights, tail, cfg.max_pattern, budget, min_prob, max_branch, cfg.prior,
            cfg.prior_decay)
        if not toks:
            return Draft()
        names = "+".join(n for i, (n, _, _, _) in enumerate(sources) if used >> i & 1)
        return Draft(toks, parents, probs, score, mlen, names)

    def record_acceptance(self, request_id: str, num_proposed: int, num_accepted: int) -> int:
        """Feed verification results to the request's window; returns the new window size.
        For a tree draft, accepting its deepest path counts as full acceptance."""
        req = self._request(request_id)
        proposed = num_proposed
        depth = _depth(req.last_draft) if req.last_draft is not None else 0
        if 0 < depth < num_proposed and num_accepted <= depth:
            proposed = depth
        return req.window.update(proposed, num_accepted)

    def predict_length(self, prompt: Union[str, Sequence[int]]) -> float:
        """Expected response length for a prompt id or prompt token ids (default if unknown)."""
        key = prompt if isinstance(prompt, str) else prompt_key(prompt)
        return self.lengths.predict(key)

    # ----------------------------------------------------------------- introspection
    @property
    def num_prompts(self) -> int:
        return len(self._prompts)

    @property
    def num_responses(self) -> int:
        return self._num_records

    @property
    def active_requests(self) -> Tuple[str, ...]:
        return tuple(self._requests)

    def reward_summary(self) -> dict:
        """The reward rule, its current coefficient and (online) the fit's evidence."""
        out = {"rule": self.config.reward_rule, "coef": self.reward_coef}
        if self._reward_fit is not None:
            out.update(self._reward_fit.summary())
        return out

    def has_prompt(self, prompt_id: str) -> bool:
        return prompt_id in self._prompts

    @property
    def residue_tokens(self) -> int:
        """Tokens of dropped prompts' responses still in the global trie (`drop_prompts`)."""
        return self._residue_tokens

    @property
    def num_run_ahead(self) -> int:
        """Live draft-only (run-ahead) records; O(records)."""
        return sum(1 for r in self.records() if r.run_ahead)

    def records(self):
        """All stored response records, least recently used prompt first."""
        for ph in self._prompts.values():
            for epoch in sorted(ph.records):
                yield from ph.records[epoch]

    def estimate_memory(self) -> int:
        """History bytes (what `memory_budget` bounds) plus live tries and length statistics."""
        live = sum(ph.live.estimate_memory() for ph in self._prompts.values() if ph.live is not None)
        return self.history_bytes() + live + self.lengths.estimate_memory()

    def check_integrity(self) -> bool:
        trees = [self._global] + [t for ph in self._prompts.values() for t in (ph.tree, ph.live) if t]
        if not all(t.check_integrity() for t in trees):
            return False
        recs = list(self.records())
        if self._trie_bytes != self._global.estimate_memory() + sum(
                ph.tree.estimate_memory() for ph in self._prompts.values()):
            return False
        if len(recs) != self._num_records or sum(len(r.seq) for r in recs) != self._num_tokens:
            return False
        if any(r.weight < 1 or r.factor <= 0 or r.key not in self._prompts for r in recs):
            return False
        if any(r.run_ahead and (r.reward is not None or r.factor != 1.0) for r in recs):
            return False
        if any(ph.num_active != sum(1 for q in self._requests.values() if q.key == k)
               for k, ph in self._prompts.items()):
            return False
        if any(ph.live.num_streams != ph.num_active  # one growing stream per active request
               for ph in self._prompts.values() if ph.live):
            return False
        ids = {id(x) for x in recs}
        if any(not r.alive for r in recs) or any(r.in_global and not self.config.use_global for r in recs):
            return False
        residue = list(self.residue_records())
        if (len(residue) != self._residue_records
                or sum(len(r.seq) for r in residue) != self._residue_tokens
                or self._residue_tokens > self.config.dropped_global_tokens
                or any(k in self._prompts for k in self._residue)
                or any(not r.alive or r.request_id is not None or r.key not in self._residue
                       for r in residue)):
            return False
        return all(id(r) in ids for r in self._finished.values())

    # ----------------------------------------------------------------- moving history
    def prompts_in_flight(self, prompt_ids: Sequence[str]) -> List[str]:
        """Those of `prompt_ids` (in their order, once each) with a request in flight."""
        check_prompt_ids(prompt_ids)
        return [k for k in dict.fromkeys(prompt_ids)
                if k in self._prompts and self._prompts[k].num_active > 0]

    def drop_prompts(self, prompt_ids: Sequence[str]) -> int:
        """Remove these prompts and their history (records, their prompt tries' contributions,
        reward bookkeeping, length statistics: their latest means stay in the prediction for
        unseen prompts, `LengthStats`); returns how many were dropped. Their
        global-trie contributions stay, up to `StoreConfig.dropped_global_tokens`, until the
        prompt comes back or newer drops push them out (`HistoryUpkeep`). Unknown ids are ignored and prompts with a
        request in flight are kept (`prompts_in_flight` names them). ValueError, and nothing
        dropped, unless `prompt_ids` is a list or tuple of non-empty strings."""
        check_prompt_ids(prompt_ids)
        dropped = 0
        for key in dict.fromkeys(prompt_ids):
            ph = self._prompts.get(key)
            if ph is None or ph.num_active > 0:
                continue
            self._drop_prompt(ph)
            dropped += 1
        return dropped

    def export_prompt(self, prompt_id: str) -> dict:
        """One prompt's history as JSON-safe data for `import_prompt` (changes nothing);
        ValueError for an unknown prompt. See `transfer`."""
        ph = self._prompts.get(prompt_id) if isinstance(prompt_id, str) else None
        if ph is None:
            raise ValueError(f"no history for prompt {prompt_id!r}")
        return prompt_state(ph, self.epoch)

    def import_prompt(self, state: dict, replace: bool = False) -> int:
        """Add an exported prompt history; returns how many responses were added.

        A record without an epoch (or with None) belongs to the store's current epoch. A
        response whose (epoch, sample) the store already holds is skipped, or replaces the held
        one when `replace` (e.g. a migrated request's full response replaces the partial one its
        finishing engine kept). Epochs outside the kept history window are skipped. All records
        are checked first: ValueError on malformed input, and nothing is added."""
        key, tail, responses = parse_prompt_state(state, self.epoch)
        return self._import_responses(key, tail, responses, replace)

    def to_state(self) -> dict:
        """The history as plain data (what a snapshot holds; see `persist`): the config, epoch
        counters, prompts with their tails in LRU order, every record (`seq` an int32 array),
        the open epoch's groups awaiting a reward flush and the length statistics. Applies
        pending reward re-weighting first; active requests and the dropped prompts' residue
        in the global trie are not part of it."""
        self._flush()
        return {
            "config": asdict(self.config),
            "epoch": self.epoch,
            "epoch_origin": self.epoch_origin,
            "prompts": [{"key": ph.key, "tail": list(ph.prompt_tail)}
                        for ph in self._prompts.values()],
            "records": [r.to_state() for r in self.records()],
            "dirty_open": sorted([list(g) for g in self._dirty_open]),
            "lengths": self.lengths.to_state(),
        }

    @classmethod
    def from_state(cls, state: dict, backend: str = "auto") -> "DraftStore":
        """A store holding the history of `state` (from `to_state`); ValueError if malformed."""
        store = cls(backend=backend)
        store._restore(state)
        return store

    def save(self, path: str) -> None:
        """Write the history to a snapshot file at `path` (atomically)."""
        write_snapshot(path, self.to_state())

    def load(self, path: str) -> None:
        """Replace this store's history with a snapshot; on any error the store is unchanged."""
        if self._requests:
            raise ValueError(f"cannot load a snapshot with active requests {list(self._requests)[:5]}")
        state = read_snapshot(path)
        try:
            self._restore(state)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def _restore(self, state: dict) -> None:
        """Replace the history with `state`'s. All of it is checked before anything changes, so
        a ValueError leaves the store as it was."""
        try:
            cfg = dict(state["config"])
            cfg["window"] = WindowConfig(**cfg["window"])
            config = StoreConfig(**cfg)
            epoch, origin = int(state["epoch"]), int(state["epoch_origin"])
            tails = {p["key"]: [int(t) for t in p["tail"]] for p in state["prompts"]}
            records = [ResponseRecord.from_state(r) for r in state["records"]]
            stray = {r.key for r in records} - tails.keys()
            if stray:
                raise ValueError(f"records of unknown prompts {sorted(stray)[:5]}")
            dirty = {(k, int(e)) for k, e in state["dirty_open"]}
            lengths = LengthStats(config.default_length)
            lengths.load_state(state["lengths"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"snapshot content is invalid ({type(exc).__name__}: {exc})") from None
        self._reset(config)
        self.epoch, self.epoch_origin, self.lengths = epoch, origin, lengths
        for key, tail in tails.items():
            self._prompts[key] = PromptHistory(key, tail, self._new_trie())
        for rec in records:
            self._prompts[rec.key].group(rec.epoch).append(rec)
            self._store(rec)
            self._num_records += 1
            self._num_tokens += len(rec.seq)
            if rec.request_id is not None and not rec.run_ahead:
                self._finished[rec.request_id] = rec
            if not rec.in_global:
                self._pending_global.append(rec)
        self._recount_trie_bytes()
        self._dirty_open = dirty

    # ----------------------------------------------------------------- internals
    def _new_trie(self, depth: Optional[int] = None):
        return make_trie(depth or self.config.max_depth, self.backend)

    def _request(self, request_id: str) -> ActiveRequest:
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request id {request_id!r}")
        return req

    def _touch(self, key: str, prompt: array) -> PromptHistory:
        ph = self._prompts.get(key)
        if ph is None:
            ph = PromptHistory(key, tail_of(prompt, self.config), self._new_trie())
            self._prompts[key] = ph
            self._trie_bytes += ph.tree.estimate_memory()
            self._end_residue(key)
        else:
            self._prompts.move_to_end(key)
        return ph


def check_prompt_ids(prompt_ids) -> None:
    """ValueError naming `prompt_ids` unless it is a list or tuple of non-empty strings."""
    if not isinstance(prompt_ids, (list, tuple)) or not all(
            isinstance(k, str) and k for k in prompt_ids):
        raise ValueError(f"prompt_ids must be a list of non-empty strings, got {prompt_ids!r:.200}")


def _depth(draft: Draft) -> int:
    depth = [0] * len(draft.parents)
    for i, p in enumerate(draft.parents):
        depth[i] = 1 + (depth[p] if p >= 0 else 0)
    return max(depth, default=0)
