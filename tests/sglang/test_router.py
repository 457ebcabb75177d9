"""RHYME servers behind the real sglang-router, SGLang's bench_serving against them, and a
prompt's history moved between engines (one set of tiny-model servers for the whole module).

* A vanilla (non-speculative) server gives greedy references, then stops.
* Two RHYME servers behind ``sglang_router`` (manual policy: the client's
  ``x-smg-routing-key`` header pins a prompt group to one engine). sglang-router 0.3.2 drops
  ``sampling_params.custom_params`` on the way, so behind it RHYME keys each prompt by the hash
  of its token ids (``prompt_key``), which still groups a prompt's samples. Round 1 of GRPO-like groups
  fills the history, the epoch advances, round 2 drafts from it: tau clearly > 1, outputs equal
  to the vanilla references.
* ``python -m sglang.bench_serving`` (random-ids, offline) runs against the router.
* A prompt's history exported from one engine and imported into the other: same drafts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from rhyme_sglang.core import prompt_key
from rhyme_sglang.server_process import RouterProcess, ServerProcess, get, post

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.server]
pytest.importorskip("sglang_router", reason="sglang-router is not installed (make setup)")

PROMPTS = {f"p{i}": [1 + i, 17, 23 + 3 * i, 5, 40 + i, 9] for i in range(4)}
GROUP, MAX_NEW = 4, 24
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
SERVER_ARGS = ["--dtype", "float32", "--max-running-requests", "16"]


def _generate(url: str, pid: str, sample: int, headers=None):
    body = {"input_ids": PROMPTS[pid], "sampling_params": {
        **GREEDY, "custom_params": {"rhyme_prompt_id": pid, "rhyme_sample": sample}}}
    status, out = post(url + "/generate", body, headers=headers, timeout=300)
    assert status == 200, out
    return out


def _round(url: str, keyed: bool = True):
    jobs = [(pid, s) for pid in PROMPTS for s in range(GROUP)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: _generate(
            url, *j, headers={"x-smg-routing-key": j[0]} if keyed else None), jobs))
    return dict(zip(jobs, outs))


@pytest.fixture(scope="module")
def references(tiny_model_path, tmp_path_factory, engines):
    engines.close_all()
    srv = ServerProcess(["--model-path", tiny_model_path, *SERVER_ARGS],
                        str(tmp_path_factory.mktemp("vanilla") / "server.log"))
    try:
        srv.wait_ready(timeout=480)
        refs = {pid: _generate(srv.url, pid, 0)["output_ids"] for pid in PROMPTS}
        # a vanilla server serves the time breakdown (and only that) under /rhyme/
        status, breakdown = get(srv.url + "/rhyme/breakdown")
        assert status == 200 and breakdown["decode"]["plain"]["steps"] >= MAX_NEW - 1, breakdown
        assert post(srv.url + "/rhyme/breakdown", {"reset": True})[0] == 200
        assert get(srv.url + "/rhyme/breakdown")[1]["decode"] == {}
        assert get(srv.url + "/rhyme/stats")[0] == 404
        return refs
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory, references):
    logs = tmp_path_factory.mktemp("cluster")
    servers = [ServerProcess(["--model-path", tiny_model_path, *SERVER_ARGS,
                              "--speculative-algorithm", "RHYME",
                              "--speculative-num-draft-tokens", "8", "--rhyme-adaptive", "0",
                              "--rhyme-snapshot-dir", str(logs / f"snap{i}")],
                             str(logs / f"server{i}.log")) for i in range(2)]
    router = None
    try:
        for s in servers:  # two servers start at once: 4 sglang imports on 2 cores
            s.wait_ready(timeout=480)
        router = RouterProcess([s.url for s in servers], ["--policy", "manual"],
                               str(logs / "router.log"))
        router.wait_ready(timeout=120)
        yield servers, router
    finally:
        for p in ([router] if router else []) + servers:
            p.stop()


def _holders(servers, key):
    return [i for i, s in enumerate(servers)
            if get(s.url + f"/rhyme/history?prompt_id={key}")[0] == 200]


def test_groups_through_the_router_draft_from_history_losslessly(cluster, references):
    servers, router = cluster
    first = _round(router.url)
    for (pid, _), out in first.items():
        assert out["output_ids"] == references[pid]
    for pid, ids in PROMPTS.items():  # the routing key kept each group on one engine
        assert len(_holders(servers, prompt_key(ids))) == 1, pid
        assert _holders(servers, pid) == []  # the router dropped custom_params
    for s in servers:  # what a weight update does
        assert post(s.url + "/rhyme/advance_epoch", {})[0] == 200
    second = _round(router.url)
    tokens = sum(len(o["output_ids"]) for o in second.values())
    verify = sum(o["meta_info"]["spec_verify_ct"] for o in second.values())
    assert tokens / verify > 2.0, (tokens, verify)  # whole greedy responses are in history
    for (pid, _), out in second.items():
        assert out["output_ids"] == references[pid]
    stats = [get(s.url + "/rhyme/stats")[1] for s in servers]
    taus = [st["per_epoch"]["1"]["tau"] for st in stats if "1" in st["per_epoch"]]
    assert taus and max(taus) > 2.0, stats


def test_bench_serving_runs_against_the_router(cluster, tiny_model_path, tmp_path):
    _, router = cluster
    out = tmp_path / "bench.jsonl"
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
           "--base-url", router.url, "--dataset-name", "random-ids", "--num-prompts", "8",
           "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "1",
           "--tokenizer", tiny_model_path, "--seed", "1", "--disable-tqdm",
           "--output-file", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == 8 and result["total_output_tokens"] == 64


def test_moved_prompt_drafts_like_its_source(cluster):
    servers, _ = cluster
    for s in servers:
        assert post(s.url + "/rhyme/reset", {})[0] == 200
    src, dst = servers
    outs = [_generate(src.url, "p1", i)["output_ids"] for i in range(2)]
    for s in servers:
        post(s.url + "/rhyme/advance_epoch", {})
    status, hist = get(src.url + "/rhyme/history?prompt_id=p1")
    assert status == 200 and len(hist["records"]) == 2
    status, body = post(dst.url + "/rhyme/history", {"history": hist})
    assert (status, body["added"]) == (200, 2)
    for cut in (0, 3, 10):
        probe = {"prompt": PROMPTS["p1"], "context": outs[0][:cut], "prompt_id": "p1"}
        a, b = (post(s.url + "/rhyme/draft", probe) for s in (src, dst))
        assert a[0] == b[0] == 200 and a[1] == b[1] and a[1]["token_ids"], (a, b)
