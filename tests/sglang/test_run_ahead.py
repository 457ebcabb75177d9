"""Issue 49 on the tiny model: a step's histories loaded into an engine (export -> drop ->
import) and run-ahead records (run-ahead requests aborted mid-way) draft for the step's real
requests, which decode the very tokens and logprobs an engine without history decodes (seeded
sampling and greedy), with drafts accepted; run-ahead requests are validated."""

from __future__ import annotations

import asyncio
import math

import pytest

from rhyme_sglang.sglang_ext.validation import check_generate_body, check_rhyme_params

PROMPTS = [[1, 5, 6, 7, 8], [3, 4, 5], [10, 11, 12, 13] * 3, [40, 41, 42, 43, 44]]
PIDS = [f"ra-p{i}" for i in range(len(PROMPTS))]
SAMPLES = 2
NEW_TOKENS = 32


def _requests(temperature: float, max_new_tokens: int = NEW_TOKENS, run_ahead: bool = False):
    """(input_ids, sampling_params) of every (prompt, sample): seeded, keyed by prompt id."""
    ids, params = [], []
    for i, (prompt, pid) in enumerate(zip(PROMPTS, PIDS)):
        for s in range(SAMPLES):
            custom = {"rhyme_prompt_id": pid, "rhyme_sample": s}
            if run_ahead:
                custom["rhyme_run_ahead"] = True
            ids.append(prompt)
            params.append({"temperature": temperature, "max_new_tokens": max_new_tokens,
                           "ignore_eos": True, "sampling_seed": 1000 + 10 * i + s,
                           "custom_params": custom})
    return ids, params


def _generate(engine, temperature: float):
    """The real requests -> (tokens, logprobs, accepted drafts) of each."""
    ids, params = _requests(temperature)
    out = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    return ([o["output_ids"] for o in out],
            [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in out],
            sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in out))


def _assert_same(got, ref, label: str) -> None:
    assert got[0] == ref[0], f"{label}: tokens differ"
    for a, b in zip(got[1], ref[1]):
        assert len(a) == len(b) and all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a, b)), \
            f"{label}: logprobs differ"


def _run_ahead_then_abort(engine, temperature: float, min_tokens: int = 40):
    """Run-ahead requests for every (prompt, sample), aborted once each streamed `min_tokens`
    tokens (long before their `max_new_tokens`, past the engine's run_ahead_min_tokens of 32
    below which a record is not kept); while they run, dropping their prompts'
    history keeps it (busy). -> (final outputs, the drop's answer while they ran)."""
    ids, params = _requests(temperature, max_new_tokens=400, run_ahead=True)
    rids = [f"ra-{temperature}-{k}" for k in range(len(ids))]
    progress = {rid: 0 for rid in rids}

    async def one(rid, prompt, p):
        gen = await engine.async_generate(input_ids=prompt, sampling_params=p, rid=rid,
                                          stream=True)
        last = None
        async for chunk in gen:
            last = chunk
            progress[rid] = len(chunk["output_ids"])
        return last

    async def main():
        tasks = [asyncio.ensure_future(one(r, i, p)) for r, i, p in zip(rids, ids, params)]
        while min(progress.values()) < min_tokens:
            if any(t.done() for t in tasks):
                raise AssertionError("a run-ahead request finished before it was aborted")
            await asyncio.sleep(0.01)
        busy = engine.rhyme_drop_history(PIDS)
        for rid in rids:
            engine.tokenizer_manager.abort_request(rid)
        return await asyncio.gather(*tasks), busy

    return engine.loop.run_until_complete(main())


@pytest.fixture(scope="module")
def rhyme(tiny):
    engine = tiny("tiny-rhyme")  # adaptive off: every decode step verifies (drafts or not)
    engine.rhyme_reset()
    return engine


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["seeded", "greedy"])
def test_loaded_and_run_ahead_histories_keep_the_tokens(rhyme, temperature):
    engine = rhyme
    engine.rhyme_reset()
    ref = _generate(engine, temperature)  # (a) no history
    assert all(len(t) == NEW_TOKENS for t in ref[0])

    # (b) the step's load cycle: export the step's histories, drop them, import them back
    engine.rhyme_advance_epoch()
    exported = engine.rhyme_export_histories(PIDS + ["ra-unknown"])
    assert [h["prompt_id"] for h in exported] == PIDS  # prompts it lacks are omitted
    assert all(len(h["records"]) == SAMPLES for h in exported)
    assert exported[0] == engine.rhyme_export_history(PIDS[0])
    dropped = engine.rhyme_drop_history(PIDS + ["ra-unknown"])
    assert dropped["dropped"] == len(PIDS) and dropped["busy"] == []
    assert dropped["num_prompts"] == 0 and engine.rhyme_stats()["num_responses"] == 0
    for h in exported:
        assert engine.rhyme_import_history(h)["added"] == SAMPLES
    loaded = _generate(engine, temperature)
    _assert_same(loaded, ref, "after export -> drop -> import")
    assert loaded[2] > ref[2], "the imported history drafted nothing more than siblings do"

    # (c) run-ahead records only: the step's requests run ahead (same seeds), aborted mid-way
    engine.rhyme_reset()
    outs, busy = _run_ahead_then_abort(engine, temperature)
    assert busy["dropped"] == 0 and sorted(busy["busy"]) == PIDS  # in flight: kept
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert all(0 < len(o["output_ids"]) < 400 for o in outs)
    stats = engine.rhyme_stats()
    assert stats["run_ahead_records"] == len(outs) == stats["num_responses"]
    marks = [r.get("run_ahead") for h in engine.rhyme_export_histories(PIDS) for r in h["records"]]
    assert marks == [True] * len(outs)
    engine.rhyme_advance_epoch()  # a weight update between the run-ahead and the real step
    ahead = _generate(engine, temperature)
    _assert_same(ahead, ref, "with run-ahead records")
    assert ahead[2] > ref[2], "the run-ahead records drafted nothing more than siblings do"
    stats = engine.rhyme_stats()
    assert stats["run_ahead_records"] == len(outs)  # the real responses joined beside them
    assert stats["num_responses"] == len(outs) + len(PROMPTS) * SAMPLES
    assert any(k.startswith("verify") and v for k, v in stats["decode_steps"].items())
    # rewards by (prompt_id, sample) reach the real responses only
    assert engine.rhyme_set_rewards([{"prompt_id": PIDS[0], "sample": 0, "reward": 1.0}]) == {
        "updated": 1}


def test_bad_run_ahead_input_is_refused_and_keeps_the_history(rhyme):
    from rhyme_sglang.sglang_ext.control import ControlError

    engine = rhyme
    engine.rhyme_reset()
    engine.generate(input_ids=PROMPTS[0], sampling_params={
        "temperature": 0, "max_new_tokens": 8, "custom_params": {"rhyme_prompt_id": PIDS[0]}})
    for custom in ({"rhyme_prompt_id": "p", "rhyme_run_ahead": "yes"},
                   {"rhyme_prompt_id": "p", "rhyme_run_ahead": 1}, {"rhyme_run_ahead": True}):
        with pytest.raises(ValueError, match="rhyme_run_ahead"):
            engine.generate(input_ids=PROMPTS[0], sampling_params={
                "temperature": 0, "max_new_tokens": 4, "custom_params": custom})
    for bad in ("ra-p0", [""], [3], None):
        for call in (engine.rhyme_drop_history, engine.rhyme_export_histories):
            with pytest.raises(ControlError, match="prompt_ids"):
                call(bad)
    assert engine.rhyme_stats()["num_responses"] == 1
    assert engine.rhyme_export_histories([]) == []


@pytest.mark.parametrize("custom", [{"rhyme_prompt_id": "p", "rhyme_run_ahead": "true"},
                                    {"rhyme_prompt_id": "p", "rhyme_run_ahead": 0},
                                    {"rhyme_run_ahead": True},
                                    {"rhyme_sample": 0, "rhyme_run_ahead": True}])
def test_run_ahead_params_are_checked(custom):
    with pytest.raises(ValueError, match="rhyme_run_ahead"):
        check_rhyme_params({"custom_params": custom})
    problem = check_generate_body({"input_ids": [1], "sampling_params": {"custom_params": custom}})
    assert problem is not None and "rhyme_run_ahead" in problem


@pytest.mark.parametrize("custom", [{"rhyme_prompt_id": "p", "rhyme_run_ahead": True},
                                    {"rhyme_prompt_id": "p", "rhyme_run_ahead": False},
                                    {"rhyme_run_ahead": False}])
def test_good_run_ahead_params_pass(custom):
    check_rhyme_params({"custom_params": custom})


def _http(routes, method: str, path: str, body, host: str = "127.0.0.1"):
    """Call a ``/rhyme/*`` handler of ``make_routes`` with a JSON body -> (status, payload)."""
    import json

    from starlette.requests import Request

    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "headers": [],
             "query_string": b"", "client": (host, 1234)}
    admin = (method, path, True) in routes
    handler = routes[(method, path, admin)]
    response = asyncio.new_event_loop().run_until_complete(handler(Request(scope, receive)))
    return response.status_code, json.loads(response.body)


class _Client:
    """A control client that answers like the worker's commands (ValueError on bad ids)."""

    def call(self, cmd, **args):
        from rhyme_sglang.sglang_ext.control import ControlError

        ids = args["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(k, str) and k for k in ids):
            raise ControlError(f"prompt_ids must be a list of non-empty strings, got {ids!r}")
        if cmd == "drop_history":
            return {"dropped": len(ids), "busy": [], "num_prompts": 0, "memory_bytes": 0}
        return [{"format": 1, "prompt_id": k, "records": []} for k in ids]


def test_drop_and_batch_export_routes():
    from rhyme_sglang.sglang_ext.http_api import make_routes

    routes = make_routes(_Client(), "/tmp", keyless_admin=True)
    status, out = _http(routes, "POST", "/rhyme/drop_history", {"prompt_ids": ["a", "b"]})
    assert status == 200 and out["dropped"] == 2 and out["busy"] == []
    status, out = _http(routes, "POST", "/rhyme/histories", {"prompt_ids": ["a"]})
    assert status == 200 and [h["prompt_id"] for h in out] == ["a"]
    for path in ("/rhyme/drop_history", "/rhyme/histories"):
        for body in ({"prompt_ids": "a"}, {}, {"prompt_ids": ["a"], "other": 1}):
            status, out = _http(routes, "POST", path, body)
            assert status == 400 and "message" in out["error"], (path, body, status)
    # dropping is an admin route (no key set: loopback clients only); exporting is read-only
    assert _http(routes, "POST", "/rhyme/drop_history", {"prompt_ids": ["a"]}, "10.0.0.9")[0] == 403
    assert _http(routes, "POST", "/rhyme/histories", {"prompt_ids": ["a"]}, "10.0.0.9")[0] == 200
