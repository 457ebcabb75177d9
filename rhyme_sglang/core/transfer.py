"""One prompt's history as plain data, to move it between draft stores (engines).

`prompt_state` turns a prompt's finished responses into JSON-safe data (ints, floats, strings);
`parse_prompt_state` checks such data and returns what another store adds. A response keeps its
epoch, sample, reward and request id, so the importing store rebuilds the same weights and, with
the same epoch, the same drafts for that prompt. A draft-only (run-ahead) record carries
``"run_ahead": true``; the key is absent on real responses (and absent means false), so exports
without run-ahead records are what the format always was. Used when a prompt moves between engines
(routing change, restart, migration): see ``DraftStore.export_prompt`` / ``import_prompt``.
"""

from __future__ import annotations

from array import array
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from . import weights as W
from .history import PromptHistory, check_tokens

FORMAT = 1


class ImportedResponse(NamedTuple):
    epoch: int
    sample: int
    response: array
    reward: Optional[float]
    request_id: Optional[str]
    run_ahead: bool = False


def prompt_state(ph: PromptHistory, epoch: int) -> Dict[str, Any]:
    """The history of one prompt, exported by a store whose current epoch is `epoch`."""
    tail = len(ph.prompt_tail)
    records = []
    for e in sorted(ph.records):
        for r in ph.records[e]:
            item = {"epoch": r.epoch, "sample": r.sample, "response": list(r.seq[tail:]),
                    "reward": r.reward, "rid": r.request_id}
            if r.run_ahead:
                item["run_ahead"] = True
            records.append(item)
    return {"format": FORMAT, "prompt_id": ph.key, "prompt_tail": list(ph.prompt_tail),
            "epoch": epoch, "records": records}


def parse_prompt_state(state: Any, current_epoch: int) -> Tuple[str, array, List[ImportedResponse]]:
    """(prompt_id, prompt_tail, responses) of an exported history; a record without an epoch
    (or with None) belongs to `current_epoch`. ValueError on malformed input."""
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
        run_ahead = item.get("run_ahead", False)
        if not isinstance(run_ahead, bool):
            raise ValueError(f"history record run_ahead must be a boolean, got {run_ahead!r}")
        if (epoch, sample, run_ahead) in seen:
            kind = "run-ahead records" if run_ahead else "records"
            raise ValueError(f"history has two {kind} for epoch {epoch} sample {sample}")
        seen.add((epoch, sample, run_ahead))
        rid = item.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise ValueError(f"history record rid must be a string, got {rid!r}")
        reward = W.check_reward(item.get("reward"))
        if run_ahead and reward is not None:
            raise ValueError(f"a run-ahead history record takes no reward, got {reward!r}")
        out.append(ImportedResponse(epoch, sample, check_tokens(item.get("response"), "response"),
                                    reward, rid, run_ahead))
    return key, tail, out


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
