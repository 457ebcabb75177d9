"""The HTTP server: malformed requests get a 4xx with a message and the server keeps serving."""

from __future__ import annotations

import json

import pytest

from rhyme_sglang.server_process import ServerProcess as Server
from rhyme_sglang.server_process import get, post

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory, engines):
    engines.close_all()  # one sglang engine at a time on this 2-core machine
    srv = Server(["--model-path", tiny_model_path, "--dtype", "float32",
                  "--speculative-algorithm", "RHYME", "--speculative-num-draft-tokens", "8",
                  "--admin-api-key", ADMIN_KEY, "--rhyme-schedule-policy", "lpt"],
                 str(tmp_path_factory.mktemp("server") / "server.log"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


ADMIN_KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
BAD = {
    "not_json": (None, b"{bad json"),
    "not_an_object": ([1, 2], None),
    "unknown_field": ({"input_ids": [1, 2], "bogus_field": 1}, None),
    "unknown_sampling_param": ({"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, None),
    "negative_max_new_tokens": ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}}, None),
    "string_max_new_tokens": ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "x"}}, None),
    "token_id_out_of_vocab": ({"input_ids": [1, 2, 10**6], "sampling_params": {"max_new_tokens": 2}}, None),
    "negative_token_id": ({"input_ids": [[1, -5]], "sampling_params": {"max_new_tokens": 2}}, None),
    "input_ids_wrong_type": ({"input_ids": "abc"}, None),
    "top_p_out_of_range": ({"text": "hi", "sampling_params": {"top_p": 1.5}}, None),
    "int_rhyme_prompt_id": ({"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2, "custom_params": {"rhyme_prompt_id": 5}}}, None),
    "negative_rhyme_sample": ({"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2, "custom_params": {"rhyme_prompt_id": "p", "rhyme_sample": -1}}}, None),
}


def test_good_request(server):
    status, body = post(server.url + "/generate", GOOD)
    assert status == 200 and len(body["output_ids"]) == 4


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_request_gets_4xx_and_server_survives(server, case):
    body, raw = BAD[case]
    status, payload = post(server.url + "/generate", body, raw=raw)
    assert 400 <= status < 500, (status, payload)
    assert "message" in json.dumps(payload)
    status, body = post(server.url + "/generate", GOOD)
    assert status == 200 and len(body["output_ids"]) == 4


def test_rhyme_round_trip(server, tmp_path):
    status, body = post(server.url + "/generate", {**GOOD, "rid": "http-r1"})
    assert status == 200
    status, stats = get(server.url + "/rhyme/stats")
    assert status == 200 and stats["num_responses"] >= 1
    status, body = post(server.url + "/rhyme/rewards",
                        {"rewards": [{"rid": "http-r1", "reward": 1.0}]}, headers=ADMIN)
    assert (status, body) == (200, {"updated": 1})
    status, body = post(server.url + "/rhyme/advance_epoch", {}, headers=ADMIN)
    assert status == 200 and body["epoch"] == stats["epoch"] + 1
    snap = str(tmp_path / "h.snap")
    assert post(server.url + "/rhyme/save", {"path": snap}, headers=ADMIN)[0] == 200
    assert post(server.url + "/rhyme/load", {"path": snap}, headers=ADMIN)[0] == 200
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
    "corrupt_snapshot": ("/rhyme/load", {"path": "/etc/hostname"}, None),
    "missing_snapshot": ("/rhyme/load", {"path": "/nonexistent/h.snap"}, None),
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
                                  "/update_weights_from_disk"])
def test_admin_endpoints_need_the_admin_key(server, path):
    status, _ = post(server.url + path, {})
    assert status in (401, 403), status
    status, _ = post(server.url + path, {}, headers={"Authorization": "Bearer wrong"})
    assert status in (401, 403), status
