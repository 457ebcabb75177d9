"""The warm start (rl_driver/warm_start.py) and the task presets it trains on.

Presets: every worked solution earns the dataset scorer's full reward, sizes follow the
long-tailed mix, seeds give disjoint problems. LoRA: a new adapter leaves the model unchanged,
and merging the saved adapter reproduces the adapted model. The stage: trains on the tiny
model, caches the folder by recipe, and the loop/config plumbing accepts ``task: NAME``.
"""

from __future__ import annotations

import json
import random
import statistics

import pytest
import torch

from rl_driver.config import ConfigError, WarmStartConfig, config_from_dict
from rl_driver.rewards import reasoning_gym_reward
from rl_driver.task_presets import PRESETS, chat, get_preset, preset_entries
from rl_driver.tasks import Prompt
from rl_driver import warm_start as ws


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_worked_solution_earns_full_reward(name):
    for entry in preset_entries(name, 12, seed=3):
        text = get_preset(name).answer(entry)
        assert reasoning_gym_reward(Prompt("p", [1], entry), text, []) == pytest.approx(1.1), text


def test_wrong_answer_earns_format_bonus_only():
    entry = preset_entries("running_sum", 1, seed=0)[0]
    text = get_preset("running_sum").answer(entry).replace(
        f"<answer>{entry['answer']}</answer>", f"<answer>{int(entry['answer']) + 1}</answer>")
    assert reasoning_gym_reward(Prompt("p", [1], entry), text, []) == pytest.approx(0.1)


def test_size_mix_is_long_tailed():
    lo, hi, tail = get_preset("running_sum").sizes
    sizes = get_preset("running_sum").draw_sizes(4000, seed=0)
    assert min(sizes) >= lo and max(sizes) <= hi
    assert statistics.median(sizes) == pytest.approx(lo + (hi - lo) / 2 ** tail, abs=2)
    assert statistics.mean(sizes) == pytest.approx(lo + (hi - lo) / (tail + 1), abs=2)
    assert max(sizes) >= 3 * statistics.median(sizes)


def test_stratified_sizes_give_a_few_prompts_the_mix_shape():
    preset = get_preset("running_sum")
    lo, hi, tail = preset.sizes
    for seed in range(20):
        sizes = sorted(preset.draw_sizes(8, seed, stratified=True))
        # one draw in each eighth of u: the k-th smallest lies in stratum k
        for k, size in enumerate(sizes):
            assert lo + int((hi - lo + 1) * (k / 8) ** tail) <= size
            assert size <= lo + int((hi - lo + 1) * ((k + 1) / 8) ** tail)
        assert sizes[-1] >= 3 * statistics.median(sizes)


def test_seeds_give_disjoint_problems_and_sizes_override():
    a = {e["question"] for e in preset_entries("running_sum", 30, seed=0)}
    b = {e["question"] for e in preset_entries("running_sum", 30, seed=10_000)}
    assert not a & b
    assert {e["task_size"] for e in preset_entries("running_sum", 20, 0, sizes=(5, 5, 1))} == {5}


def test_unknown_preset_is_a_value_error():
    with pytest.raises(ValueError, match="not a preset"):
        preset_entries("nope", 1, 0)


def test_config_accepts_a_preset_name_and_names_bad_values():
    config = config_from_dict({"task": "long_addition"})
    assert config.task.preset == "long_addition"
    with pytest.raises(ConfigError, match="task.preset"):
        config_from_dict({"task": "nope"})
    with pytest.raises(ConfigError, match="warm_start.task"):
        config_from_dict({"warm_start": {"task": "nope"}})
    with pytest.raises(ConfigError, match="warm_start.sizes"):
        config_from_dict({"warm_start": {"sizes": [9, 3, 1]}})
    assert config_from_dict({"warm_start": {"sizes": [3, 9, 2]}}).warm_start.sizes == (3, 9, 2)


def test_encode_example_marks_the_answer(tiny_tokenizer):
    entry = preset_entries("running_sum", 1, seed=0)[0]
    ids, start = ws.encode_example(tiny_tokenizer, chat("running_sum", entry, with_answer=True))
    answer = tiny_tokenizer.decode(ids[start:])
    assert answer.startswith("1. ") and answer.rstrip().endswith("<|im_end|>")
    assert get_preset("running_sum").answer(entry) in answer


def test_micro_batches_cover_every_example_within_budget():
    examples = [([0] * n, 1) for n in random.Random(0).choices(range(5, 300), k=200)]
    batches = ws.micro_batches(examples, 1024, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(200))
    for b in batches:
        assert len(b) == 1 or max(len(examples[i][0]) for i in b) * len(b) <= 1024


def test_lora_starts_unchanged_and_merges_exactly(tiny_model_path):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 9, 13, 22, 31, 7]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    wrapped = ws.add_lora(model, rank=4, alpha=8.0, seed=0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base(ids).logits)
        for m in wrapped:  # bf16-exact values, scale 2: the bf16 adapter file loses nothing
            m.lora_b.normal_(std=0.05)
            m.lora_a.copy_(m.lora_a.bfloat16().float())
            m.lora_b.copy_(m.lora_b.bfloat16().float())
        adapted = model(ids).logits
    state = {k: v.float() for k, v in ws.adapter_state(wrapped).items()}
    assert ws.merge_adapter(base, state) == len(wrapped)
    with torch.no_grad():
        assert torch.allclose(base(ids).logits, adapted, atol=1e-4)
    with pytest.raises(ValueError, match="names no module"):
        ws.merge_adapter(base, {"nowhere.lora_a": state[next(iter(state))]})


def test_ensure_trains_once_then_reuses(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("RHYME_CACHE_DIR", str(tmp_path))
    recipe = WarmStartConfig(examples=6, lora_rank=2, batch_tokens=512, sizes=(2, 4, 1),
                             eval_prompts=0)
    folder = ws.ensure(tiny_model_path, recipe, log=lambda *_: None)
    info = json.loads((folder / "warm_start.json").read_text())
    assert info["source"] == "trained" and info["training"]["examples"] == 6
    assert (folder / ws.ADAPTER_FILE).exists() and (folder / ".complete").exists()
    monkeypatch.setattr(ws, "train_adapter", lambda *a, **k: pytest.fail("retrained"))
    assert ws.ensure(tiny_model_path, recipe, log=lambda *_: None) == folder
    other = WarmStartConfig(examples=7, lora_rank=2, batch_tokens=512, sizes=(2, 4, 1),
                            eval_prompts=0)
    assert ws.output_dir(tiny_model_path, other) != folder


def test_shipped_adapter_is_merged_instead_of_training(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("RHYME_CACHE_DIR", str(tmp_path / "a"))
    recipe = WarmStartConfig(examples=4, lora_rank=2, batch_tokens=512, sizes=(2, 3, 1),
                             eval_prompts=0)
    trained = ws.ensure(tiny_model_path, recipe, log=lambda *_: None)
    monkeypatch.setattr(ws, "ADAPTER_DIR", tmp_path / "shipped")
    ws.export_adapter(trained, recipe, tiny_model_path)
    monkeypatch.setenv("RHYME_CACHE_DIR", str(tmp_path / "b"))
    monkeypatch.setattr(ws, "train_adapter", lambda *a, **k: pytest.fail("trained"))
    folder = ws.ensure(tiny_model_path, recipe, log=lambda *_: None)
    assert json.loads((folder / "warm_start.json").read_text())["source"] == "shipped adapter"
    from safetensors.torch import load_file

    a, b = (load_file(str(f / "model.safetensors")) for f in (trained, folder))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_warm_start_builds_then_prints_the_folder(tiny_model_path, tmp_path, monkeypatch,
                                                      capsys):
    from rl_driver.cli import main

    monkeypatch.setenv("RHYME_CACHE_DIR", str(tmp_path))
    argv = ["warm-start", "--task", "letter_count", "--no-eval", "--set", f"model={tiny_model_path}",
            "--set", "warm_start.examples=3", "--set", "warm_start.lora_rank=2",
            "--set", "warm_start.sizes=[2,3,1]"]
    assert main(argv) == 0
    folder = capsys.readouterr().out.strip().splitlines()[-1]
    assert "warm-letter_count-" in folder and (tmp_path / "models").exists()
    assert main(["warm-start", "--set", "warm_start.task=nope"]) == 2
    assert "warm_start.task" in capsys.readouterr().err
