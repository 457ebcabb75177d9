"""The HTTP server: malformed requests get a 4xx with a message and the server keeps serving;
fields SGLang accepts pass; snapshot paths stay inside --rhyme-snapshot-dir."""

from __future__ import annotations

import json

import pytest

from rhyme_sglang.server_process import ServerProcess as Server
from rhyme_sglang.server_process import get, post

pytestmark = [pytest.mark.sglang, pytest.mark.server]


@pytest.fixture(scope="module")
def snap_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("snapshots")


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory, engines, snap_dir):
    engines.close_all()  # one sglang engine at a time on this 2-core machine
    srv = Server(["--model-path", tiny_model_path, "--dtype", "float32",
                  "--speculative-algorithm", "RHYME", "--speculative-num-draft-tokens", "8",
                  "--admin-api-key", ADMIN_KEY, "--rhyme-schedule-policy", "lpt",
                  "--rhyme-snapshot-dir", str(snap_dir)],
                 str(tmp_path_factory.mktemp("server") / "server.log"))
    try:
        srv.wait_ready(timeout=480)
        yield srv
    finally:
        srv.stop()


ADMIN_KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
BAD = {
    "not_json": (None, b"{bad json"),
    "not_an_object": ([1, 2], None),
    "unknown_sampling_param": ({"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, None),
    "negative_max_new_tokens": ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}}, None),
    "string_max_new_tokens": ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "x"}}, None),
    "token_id_out_of_vocab": ({"input_ids": [1, 2, 10**6], "sampling_params": {"max_new_tokens": 2}}, None),
    "negative_token_id": ({"input_ids": [[1, -5]], "sampling_params": {"max_new_tokens": 2}}, None),
    "input_ids_wrong_type": ({"input_ids": "abc"}, None),
    "top_p_out_of_range": ({"text": "hi", "sampling_params": {"top_p": 1.5}}, None),
    "string_sampling_seed": ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": "x"}}, None),
    "int_rhyme_prompt_id": ({"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2, "custom_params": {"rhyme_prompt_id": 5}}}, None),
    "negative_rhyme_sample": ({"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2, "custom_params": {"rhyme_prompt_id": "p", "rhyme_sample": -1}}}, None),
}


def test_good_request(server):
    status, body = post(server.url + "/generate", GOOD)
    assert status == 200 and len(body["output_ids"]) == 4


@pytest.mark.parametrize("extra", [{"model": "tiny"}, {"bogus_field": 1}])
def test_fields_sglang_accepts_pass(server, extra):
    """sglang-router adds `model` to /generate bodies; SGLang ignores unknown top-level fields."""
    status, body = post(server.url + "/generate", {**GOOD, **extra})
    assert status == 200 and len(body["output_ids"]) == 4


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_request_gets_4xx_and_server_survives(server, case):
    body, raw = BAD[case]
    status, payload = post(server.url + "/generate", body, raw=raw)
    assert 400 <= status < 500, (status, payload)
    assert "message" in json.dumps(payload)
    status, body = post(server.url + "/generate", GOOD)
    assert status == 200 and len(body["output_ids"]) == 4


def test_seeded_requests_repeat_their_tokens(server):
    """A seed fixes a sampled answer, drafted or not (the later rounds draft from the first):
    the native ``sampling_seed`` and the OpenAI API's ``seed`` alike."""
    def generate(seed):
        status, body = post(server.url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
            "temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": seed}})
        assert status == 200, body
        return body["output_ids"]

    first = generate(7)
    assert generate(7) == first and generate(7) == first
    assert generate(8) != first
    status, models = get(server.url + "/v1/models")
    assert status == 200, models
    request = {"model": models["data"][0]["id"], "prompt": [5, 6, 7], "max_tokens": 24,
               "temperature": 1.0, "ignore_eos": True, "seed": 11}
    texts = []
    for _ in range(2):
        status, body = post(server.url + "/v1/completions", request)
        assert status == 200, body
        texts.append(body["choices"][0]["text"])
    assert texts[0] == texts[1]


def test_rhyme_round_trip(server):
    status, body = post(server.url + "/generate", {**GOOD, "rid": "http-r1"})
    assert status == 200
    status, stats = get(server.url + "/rhyme/stats")
    assert status == 200 and stats["num_responses"] >= 1
    status, body = post(server.url + "/rhyme/rewards",
                        {"rewards": [{"rid": "http-r1", "reward": 1.0}]}, headers=ADMIN)
    assert (status, body) == (200, {"updated": 1})
    status, body = post(server.url + "/rhyme/advance_epoch", {}, headers=ADMIN)
    assert status == 200 and body["epoch"] == stats["epoch"] + 1
    assert post(server.url + "/rhyme/save", {"path": "h.snap"}, headers=ADMIN)[0] == 200
    assert post(server.url + "/rhyme/load", {"path": "h.snap"}, headers=ADMIN)[0] == 200
    status, body = post(server.url + "/rhyme/predict_lengths", {"prompts": [[1, 2, 3]]})
    assert status == 200 and len(body["lengths"]) == 1
    assert get(server.url + "/rhyme/schedule_policy") == (200, {"policy": "lpt"})
    assert post(server.url + "/rhyme/schedule_policy", {"policy": "fcfs"},
                headers=ADMIN) == (200, {"policy": "fcfs"})
    assert post(server.url + "/rhyme/schedule_policy", {"policy": "lpt"},
                headers=ADMIN) == (200, {"policy": "lpt"})


RHYME_BAD = {
    "unknown_rid": ("/rhyme/rewards", {"rewards": [{"rid": "no-such-rid", "reward": 1.0}]}, None),
    "nan_reward": ("/rhyme/rewards", None, b'{"rewards": [{"rid": "http-r1", "reward": NaN}]}'),
    "inf_reward": ("/rhyme/rewards", None, b'{"rewards": [{"rid": "http-r1", "reward": Infinity}]}'),
    "string_reward": ("/rhyme/rewards", {"rewards": [{"rid": "http-r1", "reward": "high"}]}, None),
    "rewards_not_list": ("/rhyme/rewards", {"rewards": {"rid": "http-r1"}}, None),
    "missing_rewards": ("/rhyme/rewards", {}, None),
    "bad_json": ("/rhyme/rewards", None, b"{oops"),
    "unknown_field": ("/rhyme/advance_epoch", {"epoch": 7}, None),
    "outside_snapshot": ("/rhyme/load", {"path": "/etc/hostname"}, None),
    "missing_snapshot": ("/rhyme/load", {"path": "nonexistent/h.snap"}, None),
    "history_not_object": ("/rhyme/history", {"history": 5}, None),
    "history_malformed": ("/rhyme/history", {"history": {"format": 1, "prompt_id": "p",
                                                          "records": "x"}}, None),
    "history_bad_replace": ("/rhyme/history", {"history": {}, "replace": "yes"}, None),
    "bad_prompts": ("/rhyme/predict_lengths", {"prompts": [{"a": 1}]}, None),
    "unknown_policy": ("/rhyme/schedule_policy", {"policy": "shortest-first"}, None),
    "missing_policy": ("/rhyme/schedule_policy", {}, None),
}


@pytest.mark.parametrize("case", list(RHYME_BAD))
def test_rhyme_bad_input_gets_4xx_and_history_intact(server, case):
    path, body, raw = RHYME_BAD[case]
    before = get(server.url + "/rhyme/stats")[1]
    status, payload = post(server.url + path, body, raw=raw, headers=ADMIN)
    assert 400 <= status < 500, (status, payload)
    assert "message" in json.dumps(payload)
    after = get(server.url + "/rhyme/stats")[1]
    assert (after["num_responses"], after["epoch"]) == (before["num_responses"], before["epoch"])
    assert post(server.url + "/generate", GOOD)[0] == 200


@pytest.mark.parametrize("path", ["/rhyme/rewards", "/rhyme/advance_epoch", "/rhyme/save",
                                  "/rhyme/load", "/rhyme/reset", "/rhyme/schedule_policy",
                                  "/rhyme/history", "/update_weights_from_disk"])
def test_admin_endpoints_need_the_admin_key(server, path):
    status, _ = post(server.url + path, {})
    assert status in (401, 403), status
    status, _ = post(server.url + path, {}, headers={"Authorization": "Bearer wrong"})
    assert status in (401, 403), status


SECRET = b"SECRET-BYTES-9137"


@pytest.mark.parametrize("route", ["/rhyme/save", "/rhyme/load"])
def test_snapshot_paths_outside_the_directory_get_400(server, snap_dir, route):
    outside = snap_dir.parent / "outside.bin"
    outside.write_bytes(SECRET)
    link = snap_dir / f"link{route[-4:]}.snap"
    if not link.exists():
        link.symlink_to(outside)
    for path in ("../outside.bin", str(outside), "/proc/self/environ", link.name,
                 "a/../../outside.bin"):
        status, payload = post(server.url + route, {"path": path}, headers=ADMIN)
        assert status == 400 and "SECRET" not in json.dumps(payload), (path, payload)
    assert outside.read_bytes() == SECRET  # save did not write through the symlink


def test_non_snapshot_file_inside_is_refused_without_echo(server, snap_dir):
    (snap_dir / "junk.snap").write_bytes(SECRET)
    status, payload = post(server.url + "/rhyme/load", {"path": "junk.snap"}, headers=ADMIN)
    assert status == 400 and "not a draft-store snapshot" in json.dumps(payload)
    assert "SECRET" not in json.dumps(payload) and "9137" not in json.dumps(payload)


def test_history_export_import_round_trip(server):
    req = {"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0,
        "custom_params": {"rhyme_prompt_id": "http-hist", "rhyme_sample": 0}}}
    assert post(server.url + "/generate", req)[0] == 200
    status, hist = get(server.url + "/rhyme/history?prompt_id=http-hist")
    assert status == 200 and hist["prompt_id"] == "http-hist" and len(hist["records"]) == 1
    assert len(hist["records"][0]["response"]) == 4
    status, body = post(server.url + "/rhyme/history", {"history": hist}, headers=ADMIN)
    assert status == 200 and body["added"] == 0  # already held
    assert post(server.url + "/rhyme/history", {"history": hist})[0] in (401, 403)
    status, payload = get(server.url + "/rhyme/history?prompt_id=no-such-prompt")
    assert status == 400 and "no-such-prompt" in json.dumps(payload)


def test_speculation_comes_back_through_http_after_a_round_of_misses(server):
    """Issue 47 as a user meets it: /generate one request at a time, a round whose history
    misses (sampled answers), then greedy rounds (the second's history is perfect). The
    perfect round takes at least half its tokens after the first from drafts (see
    tests/sglang/test_rhyme_engine.py for the threshold), and /rhyme/stats says speculation
    is healthy."""
    prompts = [[3 + 5 * i, 60 + i, 120 + 3 * i, 9] for i in range(8)]
    sampled = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True}
    greedy = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    for p in prompts:
        assert post(server.url + "/generate", {"input_ids": [p, p], "sampling_params": sampled})[0] == 200
    outputs = []
    for _ in range(3):
        assert post(server.url + "/rhyme/advance_epoch", {}, headers=ADMIN)[0] == 200
        outputs.append([post(server.url + "/generate", {"input_ids": p, "sampling_params": greedy})[1]
                        for p in prompts])
    assert [o["output_ids"] for o in outputs[1]] == [o["output_ids"] for o in outputs[2]]
    last = outputs[2]
    drafted = (sum(o["meta_info"]["spec_num_correct_drafts"] for o in last)
               / sum(len(o["output_ids"]) - 1 for o in last))
    assert drafted >= 0.5, drafted
    status, stats = get(server.url + "/rhyme/stats")
    assert status == 200 and stats["speculation_health"]["status"] == "ok"
