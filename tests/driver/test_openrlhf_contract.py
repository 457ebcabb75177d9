"""RolloutActor answers every call OpenRLHF's trainer and weight sync make on rollout engines.

OpenRLHF (``openrlhf==0.11.2``, installed ``--no-deps`` by ``make setup`` as a test-only
dependency) is read as source with ``ast``: its engine-actor module imports vLLM and is never
imported. Every ``<engine>.<method>.remote(...)`` call and every
``batch_vllm_engine_call(engines, "<method>", ...)`` in the trainer, samples generator and
weight-sync code is collected with its positional-argument count and keyword names, then bound
against our actor's signature.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

CALLER_FILES = ("trainer/ray/ppo_actor.py", "trainer/ppo_trainer.py",
                "trainer/ppo_trainer_async.py", "trainer/ppo_utils/samples_generator.py",
                "trainer/ray/vllm_engine.py")
ENGINE_NAMES = {"engine", "llm_engine", "vllm_engine"}
NOT_ENGINE_METHODS = {"acquire", "release"}  # the async trainer's VLLMLock actor


def _openrlhf_root() -> Path:
    spec = importlib.util.find_spec("openrlhf")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("openrlhf is not installed (make setup installs openrlhf==0.11.2 --no-deps)")
    return Path(list(spec.submodule_search_locations)[0])


def _is_engine(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ENGINE_NAMES
    if isinstance(node, ast.Subscript):  # self.vllm_engines[i]
        return isinstance(node.value, ast.Attribute) and node.value.attr == "vllm_engines"
    return False


def openrlhf_engine_calls() -> list:
    """[(file, line, method, n_positional, keyword names)] of engine-actor calls."""
    root = _openrlhf_root()
    calls = []
    for rel in CALLER_FILES:
        tree = ast.parse((root / rel).read_text(), filename=rel)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "remote"
                    and isinstance(f.value, ast.Attribute) and _is_engine(f.value.value)):
                method = f.value.attr
                npos, kws = len(node.args), {k.arg for k in node.keywords}
            elif isinstance(f, ast.Name) and f.id == "batch_vllm_engine_call":
                if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
                    continue
                method = node.args[1].value
                npos, kws = len(node.args) - 2, {k.arg for k in node.keywords} - {"rank_0_only"}
            else:
                continue
            if method not in NOT_ENGINE_METHODS:
                calls.append((rel, node.lineno, method, npos, frozenset(kws)))
    return calls


def test_the_source_reading_finds_openrlhf_engine_calls():
    methods = {c[2] for c in openrlhf_engine_calls()}
    assert methods >= {"init_process_group", "update_weight", "update_weight_cuda_ipc",
                       "reset_prefix_cache", "get_num_unfinished_requests",
                       "generate_responses", "sleep", "wake_up", "pause_generation",
                       "resume_generation"}, methods


def test_rollout_actor_answers_every_openrlhf_call():
    from rl_driver.hooks import OpenRLHFRolloutActor

    problems = []
    for rel, line, method, npos, kws in openrlhf_engine_calls():
        fn = getattr(OpenRLHFRolloutActor, method, None)
        if fn is None or not inspect.iscoroutinefunction(fn) and not callable(fn):
            problems.append(f"{rel}:{line}: no method {method}")
            continue
        try:
            inspect.signature(fn).bind(None, *range(npos), **{k: None for k in kws})
        except TypeError as exc:
            problems.append(f"{rel}:{line}: {method}({npos} positional, {sorted(kws)}): {exc}")
    assert not problems, "\n".join(problems)


def test_our_parameters_keep_openrlhfs_names():
    """Where OpenRLHF's own engine actor defines a method, our parameter names include its
    (so its keyword calls keep binding if a caller switches from positional)."""
    from rl_driver.hooks import OpenRLHFRolloutActor

    tree = ast.parse((_openrlhf_root() / "trainer/ray/vllm_engine.py").read_text())
    theirs = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutRayActor")
    called = {c[2] for c in openrlhf_engine_calls()}
    for fn in theirs.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name in called:
            names = [a.arg for a in fn.args.args[1:]]
            ours = list(inspect.signature(getattr(OpenRLHFRolloutActor, fn.name)).parameters)[1:]
            missing = [n for n in names if n not in ours]
            assert not missing, (fn.name, missing)


def test_vllm_sampling_params_map_to_sglang():
    from rl_driver.hooks import vllm_to_sglang_params

    sp = SimpleNamespace(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.0, stop=["</s>"],
                         stop_token_ids=[2], ignore_eos=False, skip_special_tokens=True,
                         min_tokens=0, seed=None, max_tokens=None, logprobs=1)
    out = vllm_to_sglang_params(sp, 64)
    assert out == {"max_new_tokens": 64, "temperature": 0.7, "top_p": 0.9, "min_p": 0.0,
                   "stop": ["</s>"], "stop_token_ids": [2], "ignore_eos": False,
                   "skip_special_tokens": True, "min_new_tokens": 0}
