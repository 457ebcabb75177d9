"""bench_rollout's workload (issue 48): ``--policy warm_start`` (a preset's prompts on its
warm-started policy) or ``base`` (the old ``--datasets`` mix on the base model), and the
report's ``"workload"`` block; make_traces' ``--task``. No engine, no training: the warm start
is faked."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks import bench_rollout
from benchmarks.bench_rollout import (_trace_records, parse_args, resolve_policy,
                                      workload_block, workload_prompts)
from benchmarks.trace_stats import epoch_stats
from rl_driver.config import WarmStartConfig
from rl_driver.tasks import Prompt

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_warm_started_running_sum():
    args = parse_args([])
    assert (args.policy, args.task, args.prompts) == ("warm_start", "running_sum", "8")
    assert (args.group, args.epochs, args.max_new_tokens) == (8, 4, 1024)


def test_quick_sizes_follow_the_policy():
    warm = parse_args(["--quick", "--task", "long_addition"])
    assert warm.task == "long_addition"
    assert {k: getattr(warm, k) for k in bench_rollout.QUICK["warm_start"]} == {
        "prompts": "3", "group": 4, "epochs": 3, "max_new_tokens": 640, "repeats": 2}
    base = parse_args(["--quick", "--policy", "base"])
    assert {k: getattr(base, k) for k in bench_rollout.QUICK["base"]} == {
        "prompts": "3,1", "group": 4, "epochs": 3, "max_new_tokens": 192, "repeats": 2}
    assert parse_args(["--quick", "--max-new-tokens", "64"]).max_new_tokens == 64


def test_policy_base_keeps_the_old_dataset_mix(monkeypatch):
    args = parse_args(["--policy", "base"])
    assert (args.prompts, args.datasets) == ("12,4", "chain_sum,gsm_symbolic")
    calls = []
    monkeypatch.setattr(bench_rollout, "build_prompts",
                        lambda *a: calls.append(a) or (["p"], "tok"))
    assert workload_prompts("/models/base", args) == (["p"], "tok")
    assert calls == [("/models/base", [12, 4], ["chain_sum", "gsm_symbolic"], 0)]


@pytest.mark.parametrize("bad", [["--prompts", "3,1"], ["--task", "chain_sum"],
                                 ["--policy", "lora"]])
def test_bad_workload_arguments_are_refused(bad):
    with pytest.raises(SystemExit):
        parse_args(bad)


class _Tokenizer:
    """Just enough of a chat tokenizer: one id per character of the turns' text."""

    def apply_chat_template(self, turns, add_generation_prompt=False, tokenize=True):
        return [ord(c) % 1000 for t in turns for c in t["content"]]


def test_warm_start_prompts_are_the_presets(monkeypatch):
    pytest.importorskip("reasoning_gym")
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        staticmethod(lambda path: _Tokenizer()))
    args = parse_args(["--prompts", "3", "--seed", "2"])
    prompts, tok = workload_prompts("/models/warm", args)
    assert isinstance(tok, _Tokenizer) and len(prompts) == 3
    assert [p.prompt_id for p in prompts] == [f"running_sum-2-{i}" for i in range(3)]
    assert {p.entry["task"] for p in prompts} == {"running_sum"}


def _fake_models(monkeypatch, tmp_path, cached: bool):
    """A base folder, and ``warm_start.ensure`` faked: records its calls, returns a folder."""
    from rhyme_sglang import models
    from rl_driver import warm_start

    monkeypatch.setattr(models, "resolve_model_path", lambda name: str(tmp_path / name))
    monkeypatch.setattr(warm_start, "output_dir", lambda base, recipe: tmp_path / "warm")
    (tmp_path / "warm").mkdir()
    if cached:
        (tmp_path / "warm" / ".complete").write_text("ok\n")
    calls = []
    monkeypatch.setattr(warm_start, "ensure",
                        lambda base, recipe: calls.append((base, recipe)) or tmp_path / "warm")
    return calls


@pytest.mark.parametrize("cached", [True, False])
def test_warm_start_policy_is_ensured_once_and_said(monkeypatch, tmp_path, cached):
    calls = _fake_models(monkeypatch, tmp_path, cached)
    said = []
    folder, recipe = resolve_policy(parse_args(["--task", "letter_count"]), log=said.append)
    assert folder == str(tmp_path / "warm")
    assert recipe == WarmStartConfig(task="letter_count")
    assert calls == [(str(tmp_path / "smollm2"), recipe)]
    assert len(said) == 1 and ("cached" if cached else "building it once") in said[0]


def test_base_policy_is_the_base_model(monkeypatch, tmp_path):
    calls = _fake_models(monkeypatch, tmp_path, cached=False)
    said = []
    assert resolve_policy(parse_args(["--policy", "base"]), log=said.append) == (
        str(tmp_path / "smollm2"), None)
    assert calls == [] and said == []


def _records():
    """The trajectory's trace records as the benchmark keeps them (``_trace_records``)."""
    prompt = Prompt(prompt_id="running_sum-0-0", token_ids=[1, 2, 3], entry={})
    out = []
    for epoch, lengths in enumerate([(5, 9), (5, 12)]):
        results = [{"prompt": prompt, "sample": k, "ids": list(range(10, 10 + n)),
                    "meta": {"finish_reason": {"type": "length" if n == 12 else "stop"}}}
                   for k, n in enumerate(lengths)]
        out += _trace_records(epoch, results, [1.0, 0.0])
    return out


def test_workload_block_of_a_warm_start(tmp_path):
    folder = tmp_path / "warm-running_sum-abc"
    folder.mkdir()
    ev = {"accuracy": 0.75, "mean_length": 180.0}
    (folder / "warm_start.json").write_text(json.dumps(
        {"training": {"seconds": 471.5, "steps": 30}, "eval": ev}))
    recipe = WarmStartConfig(task="running_sum")
    block = workload_block(parse_args([]), str(folder), recipe, _records())
    assert block["policy"] == "warm_start" and block["task"] == "running_sum"
    assert block["warm_start"] == {"recipe": dataclasses.asdict(recipe),
                                   "folder": "warm-running_sum-abc", "eval": ev,
                                   "seconds": 471.5}
    assert block["trace_stats"] == epoch_stats(_records())
    assert [r["epoch"] for r in block["trace_stats"]] == [0, 1]
    assert block["trace_stats"][1]["capped"] == 1 and block["trace_stats"][1]["reuse"] > 0
    json.dumps(block)  # the report is JSON


def test_workload_block_without_warm_start_json(tmp_path):
    recipe = WarmStartConfig(task="running_sum")
    block = workload_block(parse_args([]), str(tmp_path), recipe, [])
    assert (block["warm_start"]["eval"], block["warm_start"]["seconds"]) == (None, None)
    assert block["trace_stats"] == []


def test_workload_block_of_the_base_policy():
    args = parse_args(["--policy", "base", "--datasets", "chain_sum, gsm_symbolic"])
    block = workload_block(args, "/models/base", None, _records())
    assert block["policy"] == "base" and block["warm_start"] is None
    assert block["task"] == "chain_sum,gsm_symbolic" and len(block["trace_stats"]) == 2


def _make_traces():
    path = ROOT / "scripts" / "make_traces.py"
    spec = importlib.util.spec_from_file_location("make_traces", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace_args(**kw):
    import argparse

    defaults = dict(out="out/t.jsonl.gz", epochs=None, task=None, set=[])
    return argparse.Namespace(**dict(defaults, **kw))


def test_make_traces_task_sets_the_preset_and_its_warm_start():
    from rl_driver.config import load_config

    mt = _make_traces()
    over = mt.run_overrides(_trace_args(task="long_addition", set=[("warm_start.examples", 50)]))
    config = load_config(str(ROOT / "configs" / "demo.yaml"), over)
    assert config.task.preset == "long_addition"
    assert config.warm_start.enabled and config.warm_start.task == "long_addition"
    assert config.warm_start.examples == 50 and config.loop.trace


def test_make_traces_set_wins_and_no_task_changes_nothing():
    mt = _make_traces()
    over = mt.run_overrides(_trace_args(task="running_sum", set=[("warm_start.enabled", False)]))
    assert over["warm_start.enabled"] is False and over["task.preset"] == "running_sum"
    plain = mt.run_overrides(_trace_args())
    assert not any(k.startswith(("task.", "warm_start.")) for k in plain)
