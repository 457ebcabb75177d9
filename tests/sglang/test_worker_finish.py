"""The worker's bookkeeping without an engine: a finished request joins the history with exactly
the tokens sglang returns, and group prefill holds back the right siblings."""

import threading
from types import SimpleNamespace


def _table(request_calibration=False):
    from rhyme_sglang.core import DraftStore
    from rhyme_sglang.core.cost_model import SpecCostModel
    from rhyme_sglang.core.requests import RequestTable
    from rhyme_sglang.sglang_ext.stats import SpecStats

    return RequestTable(DraftStore(), SpecCostModel(widths=(1, 2, 4)), SpecStats(),
                        request_calibration)


def _scheduling(**config):
    from rhyme_sglang.core import DraftStore
    from rhyme_sglang.sglang_ext.config import RhymeConfig
    from rhyme_sglang.sglang_ext.scheduling import Scheduling
    from rhyme_sglang.sglang_ext.stats import SpecStats

    return Scheduling(DraftStore(), SpecStats(), RhymeConfig(**config), threading.RLock())


def _req(rid, output_ids, finished_len):
    custom = {"rhyme_prompt_id": "p", "rhyme_sample": int(rid[-1])}
    return SimpleNamespace(
        rid=rid, origin_input_ids_unpadded=[5, 6, 7], output_ids=list(output_ids),
        output_ids_through_stop=list(output_ids[:finished_len]), finished_reason=None,
        sampling_params=SimpleNamespace(custom_params=custom), finished=lambda: True)


def _sync(table, req, out_ids):
    from rhyme_sglang.sglang_ext.worker import track

    track(table, req)
    table.sync(req.rid, out_ids)


def test_tokens_a_verify_step_accepted_past_the_stop_stay_out_of_the_history():
    """A verify step can accept tokens past max_new_tokens or a stop; sglang keeps them in
    ``output_ids`` and returns ``output_ids_through_stop``, and so must the history."""
    from sglang.srt.managers.schedule_batch import Req

    from rhyme_sglang.sglang_ext.worker import finish_finished

    assert isinstance(getattr(Req, "output_ids_through_stop", None), property)
    table = _table()
    _sync(table, _req("r0", [9, 9], 4), [9, 9])  # synced while decoding, before the finish
    reqs = [_req("r0", [9, 9, 9, 9, 9], 4), _req("r1", [8, 8, 8], 3)]
    finish_finished(table, reqs)
    responses = sorted(r["response"] for r in table.store.export_prompt("p")["records"])
    assert responses == [[8, 8, 8], [9, 9, 9, 9]]
    assert len(table) == 0
    table.check_integrity()


def test_a_finished_request_joins_the_history_once():
    """The stream hook (before the output leaves) and the batch-result hook (after) both see a
    finished request; it is added once."""
    from rhyme_sglang.sglang_ext.worker import finish_finished

    table = _table()
    reqs = [_req("r0", [9, 9, 9], 3)]
    finish_finished(table, reqs)
    finish_finished(table, reqs)
    assert table.store.num_responses == 1 and len(table) == 0


def test_the_stream_hook_runs_before_sglangs_output_streamer():
    """Finished responses reach the history before a client can read them: the hook is
    registered BEFORE sglang's ``stream_output``, at a path that resolves (sglang only logs a
    target it cannot resolve); so does the idle hook."""
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from rhyme_sglang.sglang_ext import plugin

    plugin.register()
    target = ("sglang.srt.managers.scheduler_components.output_streamer."
              "SchedulerOutputStreamer.stream_output")
    assert (HookType.BEFORE, plugin.stream_hook) in [
        (kind, hook) for kind, hook, *_ in HookRegistry._hooks[target]]
    assert callable(pkgutil.resolve_name(target))
    idle = "sglang.srt.managers.scheduler.Scheduler.on_idle"
    assert (HookType.AFTER, plugin.idle_hook) in [
        (kind, hook) for kind, hook, *_ in HookRegistry._hooks[idle]]
    assert callable(pkgutil.resolve_name(idle))


def test_the_cost_models_horizon_comes_from_the_store_and_the_waiting_queue():
    """Each running request's predicted remainder (its prompt's predicted length less what it
    generated) and the waiting queue's predicted tokens, noted by the prefill hook after each
    scheduling pass, reach the cost model."""
    from rhyme_sglang.sglang_ext import plugin
    from rhyme_sglang.sglang_ext.config import RhymeConfig
    from rhyme_sglang.sglang_ext.worker import ACTIVE_WORKERS

    scheduling = _scheduling(group_prefill=False)
    for sample, n in enumerate((40, 60)):  # prompt "p": predicted 50 tokens
        scheduling.store.add_response("p", [5, 6, 7], [1] * n, 0, sample=sample)
    running = [_req("r0", [9] * 10, 10), _req("r1", [9] * 45, 45)]
    waiting = [_req("w2", [], 0), _req("w3", [], 0)]
    scheduler = SimpleNamespace(waiting_queue=waiting)
    ACTIVE_WORKERS[:] = [SimpleNamespace(scheduling=scheduling)]
    try:
        assert plugin.prefill_hook(lambda *a, **k: "batch", scheduler, None) == "batch"
    finally:
        ACTIVE_WORKERS[:] = []
    assert scheduling.queued == 100.0  # two waiting requests of the 50-token prompt
    horizon = scheduling.horizon(running)
    assert horizon.remaining == (40.0, 22.5) and horizon.queued == 100.0  # 45 > 2/3 x 50
    assert horizon.critical() == (0,) and horizon.background == frozenset()
    ahead = _req("a2", [], 0)  # a fresh run-ahead request: the whole prediction to go
    ahead.sampling_params.custom_params["rhyme_run_ahead"] = True
    horizon = scheduling.horizon(running + [ahead])
    assert horizon.background == {2} and horizon.critical() == (0,) and horizon.longest == 40.0
    assert scheduling.horizon([ahead]).background == frozenset()  # alone: the engine's work
    scheduling.config = RhymeConfig(horizon=False)
    scheduling.note_waiting([])
    assert scheduling.queued == 100.0  # off: not kept


class _Cache:
    """A prefix cache holding whole prompts (the calls ``_prompt_cached`` makes)."""

    def __init__(self, prompts, sharing=True):
        self.prompts, self.sharing, self.matches = [list(p) for p in prompts], sharing, 0

    def supports_prefix_sharing(self):
        return self.sharing

    def swa_reprefill_tail_tokens(self, req):
        return 0

    def match_prefix(self, params):
        self.matches += 1
        key = list(params.key.token_ids)[: params.key.limit]
        hit = max((n for p in self.prompts for n in range(len(key) + 1) if p[:n] == key[:n]),
                  default=0)
        return SimpleNamespace(device_prefix_len=hit)


def _waiting(rid, prompt):
    return SimpleNamespace(rid=rid, origin_input_ids=list(prompt), origin_input_ids_unpadded=list(prompt),
                           extra_key=None, cache_salt=None,
                           sampling_params=SimpleNamespace(custom_params=None))


def test_group_prefill_holds_siblings_only_of_prompts_the_cache_lacks():
    """One request per uncached prompt group prefills first; a group whose prompt the cache
    holds goes whole, and a cache that shares no prefix holds nothing back."""
    scheduling = _scheduling()
    cached, fresh = list(range(100, 140)), list(range(200, 240))
    queue = [_waiting(f"c{i}", cached) for i in range(3)] + [_waiting(f"f{i}", fresh) for i in range(3)]
    cache = _Cache([cached])
    held = scheduling.hold_back_siblings(queue, [], None, cache)
    assert [r.rid for r in held] == ["f1", "f2"]
    assert [r.rid for r in queue] == ["c0", "c1", "c2", "f0"]
    assert scheduling.stats.as_dict()["group_prefill_held"] == 2
    queue.extend(held)  # the same firsts of their groups in the next pass
    scheduling.hold_back_siblings(queue, [], None, cache)
    assert cache.matches == 2  # each group's first request is asked once, then remembered
    queue.extend(held)
    assert scheduling.hold_back_siblings(queue, [], None, _Cache([], sharing=False)) == []
    assert scheduling.hold_back_siblings(queue, [], None) != []  # no cache given: groups as before


def test_path_dependent_penalties_are_the_ones_a_tree_node_changes():
    """No drafts for a request whose penalties depend on the tokens above a tree node, and
    for ``min_new_tokens`` only until it is reached (a plain step's count until then)."""
    from rhyme_sglang.sglang_ext.worker import path_dependent_penalties

    def req(n_out=0, **params):
        base = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                "min_new_tokens": 0}
        return SimpleNamespace(sampling_params=SimpleNamespace(**{**base, **params}),
                               output_ids=[7] * n_out)

    assert not path_dependent_penalties(req())
    assert path_dependent_penalties(req(frequency_penalty=0.5))
    assert path_dependent_penalties(req(presence_penalty=-0.2))
    assert path_dependent_penalties(req(repetition_penalty=1.1))
    assert path_dependent_penalties(req(n_out=29, min_new_tokens=30))
    assert not path_dependent_penalties(req(n_out=30, min_new_tokens=30))


def test_a_requests_failed_verifies_lower_its_expected_gains():
    """Each verify's accepted drafts against the calibration's expectation go to the request's
    evidence (``sync``); its draft nodes' gains shrink with it, a sibling's do not, and
    ``request_calibration=False`` (the default) turns it off."""
    table = _table(request_calibration=True)
    cost = table.cost
    bad, good = _req("r0", [], 0), _req("r1", [], 0)
    out = {"r0": [], "r1": []}
    for req in (bad, good):
        _sync(table, req, out[req.rid])
    probs = [0.9, 0.8]  # a chain's path probabilities, best first
    before = cost.node_gains(probs, table.evidence_factor("r0"))
    for _ in range(5):  # r0's verifies of 2 drafts accept none; r1's plain steps
        table.propose("r0", 2, 1.7, 1.7)
        assert table.get("r0").expected == cost.calibrated(1.7)
        out["r0"].append(1)
        out["r1"].append(1)
        for req in (bad, good):
            _sync(table, req, out[req.rid])
    after = cost.node_gains(probs, table.evidence_factor("r0"))
    # the shared calibration learns from these verifies too (it feeds the expectation)
    assert table.evidence_factor("r0") < 0.5 and after[0] < 0.5 * before[0]
    assert table.evidence_factor("r1") == 1.0
    table.request_calibration = False  # off: the factor is 1 and the evidence is not kept
    assert table.evidence_factor("r0") == 1.0
    kept = table.get("r0").evidence.expected
    table.propose("r0", 2, 1.7, 1.7)
    out["r0"].append(1)
    _sync(table, bad, out["r0"])
    assert table.get("r0").evidence.expected == kept
    table.check_integrity()
