"""A finished request joins the history with exactly the tokens sglang returns (no engine)."""

import threading
from types import SimpleNamespace


def _worker():
    from rhyme_sglang.core import DraftStore
    from rhyme_sglang.core.cost_model import SpecCostModel
    from rhyme_sglang.sglang_ext.stats import SpecStats
    from rhyme_sglang.sglang_ext.worker import RhymeWorker

    worker = RhymeWorker.__new__(RhymeWorker)  # the history bookkeeping only, no sglang worker
    worker.lock, worker.store, worker.stats = threading.RLock(), DraftStore(), SpecStats()
    worker.cost, worker._tracked = SpecCostModel(widths=(1, 2, 4)), {}
    return worker


def _req(rid, output_ids, finished_len):
    custom = {"rhyme_prompt_id": "p", "rhyme_sample": int(rid[-1])}
    return SimpleNamespace(
        rid=rid, origin_input_ids_unpadded=[5, 6, 7], output_ids=list(output_ids),
        output_ids_through_stop=list(output_ids[:finished_len]), finished_reason=None,
        sampling_params=SimpleNamespace(custom_params=custom), finished=lambda: True)


def test_tokens_a_verify_step_accepted_past_the_stop_stay_out_of_the_history():
    """A verify step can accept tokens past max_new_tokens or a stop; sglang keeps them in
    ``output_ids`` and returns ``output_ids_through_stop``, and so must the history."""
    from sglang.srt.managers.schedule_batch import Req

    assert isinstance(getattr(Req, "output_ids_through_stop", None), property)
    worker = _worker()
    worker._sync(_req("r0", [9, 9], 4), [9, 9])  # synced while decoding, before the finish
    worker.on_batch_result(SimpleNamespace(reqs=[_req("r0", [9, 9, 9, 9, 9], 4),
                                                 _req("r1", [8, 8, 8], 3)]))
    responses = sorted(r["response"] for r in worker.store.export_prompt("p")["records"])
    assert responses == [[8, 8, 8], [9, 9, 9, 9]]
    assert worker._tracked == {}


