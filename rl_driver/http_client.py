"""``RolloutHTTPClient``: the ``RolloutActor`` method set against a running rhyme-sglang server.

Start a server with ``rhyme-sglang-server --model-path ... --speculative-algorithm RHYME``
and point this client at its URL. It speaks sglang's HTTP API (``/generate``,
``/update_weights_from_disk``, ``/flush_cache``, ``/pause_generation``,
``/continue_generation``, ``/abort_request``) and rhyme-sglang's ``/rhyme/*`` routes.
Methods are synchronous (``requests``); results have the same shape as the actor's.
Tensor and process-group weight updates need the engine in-process: over HTTP, weights
travel through disk (``update_weights_from_disk``).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional
from urllib.parse import urlencode

from rl_driver.rollout import finish_type


class HTTPError(RuntimeError):
    """The server answered with an error status; the message carries its body."""


class RolloutHTTPClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0, api_key: Optional[str] = None):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        import requests

        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.weight_version = 0

    def _request(self, method: str, path: str, body: Optional[Dict[str, Any]] = None):
        resp = self.session.request(method, self.base_url + path, json=body, timeout=self.timeout_s)
        if resp.status_code >= 400:
            raise HTTPError(f"{method} {path} -> {resp.status_code}: {resp.text[:500]}")
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    # ---- generation -------------------------------------------------------------------------
    def generate_one(self, request: Dict[str, Any]) -> Dict[str, Any]:
        params = dict(request["sampling_params"])
        if "prompt_id" in request:
            params["custom_params"] = {"rhyme_prompt_id": str(request["prompt_id"]),
                                       "rhyme_sample": int(request.get("sample", 0))}
        start = time.time()
        out = self._request("POST", "/generate", {
            "input_ids": list(request["input_ids"]), "sampling_params": params,
            "rid": request["rid"], "return_logprob": True})
        meta = out["meta_info"]
        return {
            "rid": request["rid"], "engine": self.base_url, "output_ids": list(out["output_ids"]),
            "logprobs": [float(lp[0]) for lp in meta.get("output_token_logprobs") or []],
            "finish_reason": finish_type(meta),
            "spec_verify_ct": int(meta.get("spec_verify_ct") or 0),
            "completion_tokens": int(meta.get("completion_tokens") or len(out["output_ids"])),
            "start_s": start, "end_s": time.time(), "weight_version": self.weight_version,
        }

    def generate(self, input_ids: List[List[int]], sampling_params: Any,
                 rids: Optional[List[str]] = None) -> List[Dict[str, Any]]:
        from concurrent.futures import ThreadPoolExecutor

        rids = rids or [f"http-{time.monotonic_ns()}-{i}" for i in range(len(input_ids))]
        params = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params] * len(input_ids)
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(input_ids)))) as pool:
            return list(pool.map(lambda a: self.generate_one(
                {"rid": a[0], "input_ids": a[1], "sampling_params": a[2]}),
                zip(rids, input_ids, params)))

    def abort(self, rids: List[str]) -> int:
        for rid in rids:
            self._request("POST", "/abort_request", {"rid": rid})
        return len(rids)

    def pause_generation(self, mode: str = "in_place"):
        return self._request("POST", "/pause_generation", {"mode": mode})

    def resume_generation(self):
        return self._request("POST", "/continue_generation", {})

    def reset_prefix_cache(self) -> bool:
        deadline = time.monotonic() + 30
        while True:
            try:
                self._request("POST", "/flush_cache")
                return True
            except HTTPError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)

    def update_weights_from_disk(self, path: str, weight_version: Optional[int] = None) -> bool:
        body: Dict[str, Any] = {"model_path": path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        out = self._request("POST", "/update_weights_from_disk", body)
        if weight_version is not None:
            self.weight_version = int(weight_version)
        return bool(out.get("success", True)) if isinstance(out, dict) else True

    # ---- RHYME history ---------------------------------------------------------------------
    def rhyme_set_rewards(self, rewards: List[Dict[str, Any]]) -> Dict[str, Any]:
        return self._request("POST", "/rhyme/rewards", {"rewards": rewards})

    def rhyme_advance_epoch(self) -> int:
        return int(self._request("POST", "/rhyme/advance_epoch", {})["epoch"])

    def rhyme_stats(self) -> Dict[str, Any]:
        return self._request("GET", "/rhyme/stats")

    def rhyme_save(self, path: str) -> bool:
        """``path`` is relative to the server's ``--rhyme-snapshot-dir``."""
        self._request("POST", "/rhyme/save", {"path": path})
        return True

    def rhyme_load(self, path: str) -> bool:
        self._request("POST", "/rhyme/load", {"path": path})
        return True

    def rhyme_reset(self) -> bool:
        self._request("POST", "/rhyme/reset", {})
        return True

    def rhyme_export_history(self, prompt_id: str) -> Optional[Dict[str, Any]]:
        """The prompt's history on this server, None when it holds none."""
        try:
            return self._request("GET", "/rhyme/history?" + urlencode({"prompt_id": prompt_id}))
        except HTTPError as exc:
            if " 400: " in str(exc) and "no history" in str(exc):
                return None
            raise

    def rhyme_import_history(self, history: Dict[str, Any], replace: bool = False) -> int:
        return int(self._request("POST", "/rhyme/history",
                                 {"history": history, "replace": replace})["added"])

    def rhyme_predict_lengths(self, prompts: List[Any]) -> List[float]:
        return [float(x) for x in self._request("POST", "/rhyme/predict_lengths",
                                                {"prompts": prompts})["lengths"]]
