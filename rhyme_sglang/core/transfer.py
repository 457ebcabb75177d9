"""One prompt's history as plain data, to move it between draft stores (engines).

`export_prompt` reads a prompt's finished responses (JSON-safe: ints, floats, strings);
`import_prompt` adds them to another store. A response keeps its epoch, sample, reward and
request id, so the importing store rebuilds the same weights and, with the same epoch, the same
drafts for that prompt. Used when a prompt moves between engines (routing change, restart,
migration): see ``DraftStore.export_prompt`` / ``import_prompt``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from . import weights as W
from .history import check_tokens

FORMAT = 1


def export_prompt(store, prompt_id: str) -> Dict[str, Any]:
    """The prompt's history (does not change state); ValueError for an unknown prompt."""
    ph = store._prompts.get(prompt_id) if isinstance(prompt_id, str) else None
    if ph is None:
        raise ValueError(f"no history for prompt {prompt_id!r}")
    tail = len(ph.prompt_tail)
    records = [{"epoch": r.epoch, "sample": r.sample, "response": list(r.seq[tail:]),
                "reward": r.reward, "rid": r.request_id}
               for epoch in sorted(ph.records) for r in ph.records[epoch]]
    return {"format": FORMAT, "prompt_id": ph.key, "prompt_tail": list(ph.prompt_tail),
            "epoch": store.epoch, "records": records}


def _checked(state: Any, current_epoch: int) -> tuple:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"history must be an object with format {FORMAT} (from export)")
    key = state.get("prompt_id")
    if not isinstance(key, str) or not key:
        raise ValueError(f"history prompt_id must be a non-empty string, got {key!r}")
    tail = check_tokens(state.get("prompt_tail", []), "prompt_tail")
    items = state.get("records")
    if not isinstance(items, list):
        raise ValueError("history records must be a list")
    out, seen = [], set()
    for item in items:
        if not isinstance(item, dict):
            raise ValueError(f"each history record must be an object, got {type(item).__name__}")
        epoch, sample = item.get("epoch", current_epoch), item.get("sample")
        epoch = current_epoch if epoch is None else epoch
        for name, v in (("epoch", epoch), ("sample", sample)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"history record {name} must be an int >= 0, got {v!r}")
        if (epoch, sample) in seen:
            raise ValueError(f"history has two records for epoch {epoch} sample {sample}")
        seen.add((epoch, sample))
        rid = item.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise ValueError(f"history record rid must be a string, got {rid!r}")
        out.append((epoch, sample, check_tokens(item.get("response"), "response"),
                    W.check_reward(item.get("reward")), rid))
    return key, tail, out


def import_prompt(store, state: Dict[str, Any], replace: bool = False) -> int:
    """Add an exported prompt history; returns how many responses were added.

    A record without an epoch (or with None) belongs to the store's current epoch. A response
    whose (epoch, sample) the store already holds is skipped, or replaces the held
    one when `replace` (e.g. a migrated request's full response replaces the partial one its
    finishing engine kept). Epochs outside the kept history window are skipped. All records are
    checked first: ValueError on malformed input, and nothing is added."""
    key, tail, records = _checked(state, store.epoch)
    ph = store._touch(key, tail)
    added = 0
    for epoch, sample, response, reward, rid in records:
        if store._too_old(epoch):
            continue
        held = ph.find(epoch, sample)
        if held is not None:
            if not replace:
                continue
            _remove_record(store, ph, held)
        if rid is not None and rid in store._finished:
            rid = None  # request ids stay unique within a store
        store._add_record(ph, response, epoch, sample, reward, rid)
        added += 1
    store._drop_if_empty(ph)
    store._enforce_budget()
    return added


def _remove_record(store, ph, rec) -> None:
    store._apply(rec, -1, -rec.weight)
    if not rec.in_global:
        store._pending_global = [r for r in store._pending_global if r is not rec]
    rec.alive = False
    group: List = ph.records[rec.epoch]
    group.remove(rec)
    if not group:
        del ph.records[rec.epoch]
    store._num_records -= 1
    store._num_tokens -= len(rec.seq)
    if rec.request_id is not None:
        store._finished.pop(rec.request_id, None)
    store._mark_dirty(ph.key, rec.epoch)


def response_state(prompt_id: str, prompt_ids, response_ids, sample: int,
                   reward: Optional[float] = None, epoch: Optional[int] = None) -> Dict[str, Any]:
    """An importable history of one response (e.g. a migrated request's full response, which
    the driver holds; ``epoch=None``: the importing store's current epoch). The importing store
    keeps its own prompt-tail length."""
    return {"format": FORMAT, "prompt_id": prompt_id,
            "prompt_tail": list(check_tokens(prompt_ids, "prompt_ids")), "epoch": epoch,
            "records": [{"epoch": epoch, "sample": sample, "response": list(response_ids),
                         "reward": reward, "rid": None}]}


def states_from_responses(responses) -> List[Dict[str, Any]]:
    """Import states (one per prompt, for `import_prompt`) from finished responses given as
    ``(prompt_id, prompt_token_ids, epoch, sample, response_token_ids, reward)`` tuples, e.g.
    a rollout trace's records: how a fresh engine gets the history of a run it did not serve."""
    states: Dict[str, Dict[str, Any]] = {}
    for prompt_id, prompt, epoch, sample, response, reward in responses:
        state = states.setdefault(prompt_id, {"format": FORMAT, "prompt_id": prompt_id,
                                              "prompt_tail": list(prompt), "records": []})
        state["records"].append({"epoch": epoch, "sample": sample, "response": list(response),
                                 "reward": reward})
    return list(states.values())
