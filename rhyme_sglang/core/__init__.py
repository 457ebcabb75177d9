"""Engine-agnostic core of rhyme-sglang (standard library + numpy only).

Typical use from an engine adapter::

    store = DraftStore(StoreConfig())
    store.start_request("r1", prompt_ids, prompt_id="p7", sample=3)
    store.add_tokens("r1", new_ids)                 # after every decode/verify step
    draft = store.speculate("r1", max_tokens=8)     # Draft(token_ids, parents, probs, ...)
    store.record_acceptance("r1", len(draft), num_accepted)
    store.finish_request("r1", reward=None)         # response joins the prompt's history
    store.set_reward("r1", 1.0); store.advance_epoch()
"""

from .config import StoreConfig, WindowConfig
from .draft import Draft, accepted_length
from .history import ResponseRecord, prompt_key
from .lengths import LengthStats, LengthSummary
from .native import make_trie, native_available
from .ordering import (assign_groups_lpt, assign_groups_round_robin, group_leaders, lpt_group_order, lpt_order,
                       makespan)
from .pytree import PySuffixTrie
from .store import DraftStore
from .trace import TraceRecord, iter_trace, read_trace, write_trace
from .window import SpecWindow

__all__ = [
    "Draft", "DraftStore", "LengthStats", "LengthSummary", "PySuffixTrie", "ResponseRecord",
    "SpecWindow", "StoreConfig", "WindowConfig", "accepted_length", "assign_groups_lpt",
    "assign_groups_round_robin", "group_leaders", "lpt_group_order", "lpt_order", "make_trie", "makespan", "native_available",
    "prompt_key", "TraceRecord", "iter_trace", "read_trace", "write_trace",
]
