"""``RolloutHTTPClient`` against a small hand-written HTTP server that records each request
and answers like sglang / the ``/rhyme/*`` routes (the client's wire format, no engine)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from rl_driver.http_client import HTTPError, RolloutHTTPClient


class _Handler(BaseHTTPRequestHandler):
    calls: list = []

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _reply(self, status, body):
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.calls.append((self.command, self.path, body))
        if self.path == "/generate":
            n = body["sampling_params"]["max_new_tokens"]
            self._reply(200, {"output_ids": list(range(n)), "meta_info": {
                "finish_reason": {"type": "length"}, "completion_tokens": n,
                "output_token_logprobs": [[-0.5, t, None] for t in range(n)]}})
        elif self.path == "/rhyme/rewards" and body["rewards"][0].get("prompt_id") == "bad":
            self._reply(400, {"error": "unknown reward target(s)"})
        elif self.path == "/rhyme/rewards":
            self._reply(200, {"updated": len(body["rewards"])})
        elif self.path == "/rhyme/advance_epoch":
            self._reply(200, {"epoch": 3})
        elif self.path == "/rhyme/stats":
            self._reply(200, {"epoch": 3, "tau": 2.5})
        elif self.path == "/rhyme/predict_lengths":
            self._reply(200, {"lengths": [10.0 * (i + 1) for i in range(len(body["prompts"]))]})
        elif self.path.startswith("/rhyme/history?prompt_id="):
            known = self.path.endswith("=p")
            self._reply(200 if known else 400, {"format": 1, "prompt_id": "p", "records": []}
                        if known else {"error": {"message": "no history for prompt 'q'"}})
        elif self.path == "/rhyme/history":
            self._reply(200, {"added": len(body["history"]["records"]), "num_responses": 1})
        elif self.path == "/update_weights_from_disk":
            self._reply(200, {"success": True, "message": "ok"})
        else:
            self._reply(200, None)

    do_GET = do_POST = _handle


@pytest.fixture()
def server():
    _Handler.calls = []
    httpd = HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", _Handler.calls
    httpd.shutdown()


def test_generate_and_rhyme_routes(server):
    url, calls = server
    client = RolloutHTTPClient(url)
    out = client.generate_one({"rid": "r1", "prompt_id": "p", "sample": 2, "input_ids": [1, 2],
                               "sampling_params": {"max_new_tokens": 3}})
    assert out["output_ids"] == [0, 1, 2] and out["logprobs"] == [-0.5] * 3
    assert out["finish_reason"] == "length"
    method, path, body = calls[0]
    assert (method, path, body["rid"], body["return_logprob"]) == ("POST", "/generate", "r1", True)
    assert body["sampling_params"]["custom_params"] == {"rhyme_prompt_id": "p", "rhyme_sample": 2}
    assert len(client.generate([[1], [2]], {"max_new_tokens": 2})) == 2
    assert client.rhyme_set_rewards([{"prompt_id": "p", "sample": 2, "reward": 1.0}]) == {"updated": 1}
    assert client.rhyme_advance_epoch() == 3 and client.rhyme_stats()["tau"] == 2.5
    assert client.rhyme_predict_lengths(["p", [1, 2]]) == [10.0, 20.0]
    assert client.rhyme_save("/tmp/x") and client.rhyme_load("/tmp/x") and client.rhyme_reset()
    assert client.update_weights_from_disk("/w", weight_version=4) and client.weight_version == 4
    hist = client.rhyme_export_history("p")
    assert hist["prompt_id"] == "p" and client.rhyme_export_history("q") is None
    assert client.rhyme_import_history({**hist, "records": [{}]}, replace=True) == 1
    assert calls[-1][2] == {"history": {**hist, "records": [{}]}, "replace": True}
    assert client.reset_prefix_cache()
    client.pause_generation()
    client.resume_generation()
    paths = [p for _, p, _ in calls]
    for expected in ("/rhyme/save", "/rhyme/load", "/rhyme/reset", "/flush_cache",
                     "/pause_generation", "/continue_generation", "/update_weights_from_disk"):
        assert expected in paths


def test_errors_are_reported(server):
    url, _ = server
    client = RolloutHTTPClient(url)
    with pytest.raises(HTTPError, match="400.*unknown reward target"):
        client.rhyme_set_rewards([{"prompt_id": "bad", "sample": 0, "reward": 1.0}])
    with pytest.raises(ValueError, match="base_url"):
        RolloutHTTPClient("localhost:30000")
