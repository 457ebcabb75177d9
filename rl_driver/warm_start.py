"""The warm start: a short SFT that makes the base model follow a task's procedure before RL.

RL starts from a policy that can do its task's format (a cold-start SFT on worked solutions);
this stage makes that policy from the base model and a :mod:`rl_driver.task_presets` task:

- **Data.** ``examples`` items of the preset's size mix, drawn with seed ``seed + 10_000``
  (disjoint from the RL prompts, which use ``seed``), each (system, question, exact worked
  solution). The held-out evaluation uses seed ``seed + 20_000``.
- **Training.** LoRA adapters of rank ``lora_rank`` on every linear layer of every block (the
  base weights frozen), AdamW, linear warm-up then linear decay, ``epochs`` passes; loss on
  the assistant's tokens and its ``<|im_end|>`` only, logits computed only there;
  length-sorted micro-batches of at most ``batch_tokens`` padded tokens, right padding without
  an attention mask (padded positions carry no loss and no later token reads them); bf16
  autocast only where the CPU computes bf16 natively (:func:`rhyme_sglang.dtypes.resolve_train_dtype`).
- **Output.** The adapter merged into the base weights, saved as a Hugging Face folder in the
  models cache under ``warm-<task>-<key>``, ``key`` a hash of (base model, task, recipe, seed);
  the adapter itself (``adapter/adapter.safetensors``, a few MB; in a subfolder, since an engine
  loads every ``*.safetensors`` at a model folder's top) sits beside it. A later run reuses the
  folder. An adapter shipped in ``rl_driver/adapters/<task>-<key>.safetensors`` is merged instead
  of training (seconds instead of minutes); ``rhyme-rl warm-start --export`` writes one.
- **Evaluation.** ``eval_prompts`` held-out prompts x ``eval_samples`` samples at temperature 1.0
  on the project's engine (vanilla decoding): accuracy, mean length, the share that stop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

ADAPTER_DIR = Path(__file__).resolve().parent / "adapters"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_FILE = "adapter/adapter.safetensors"  # inside a warm-started folder
RECIPE_VERSION = 1  # bump when the training code changes what a recipe produces


NOT_IN_KEY = ("enabled", "eval_prompts", "eval_samples")  # recipe fields that leave the weights alone


def cache_key(base_model: str, recipe) -> str:
    """A hash of (base model folder name, the recipe's fields that shape the weights, the
    recipe version)."""
    fields = {k: v for k, v in dataclasses.asdict(recipe).items() if k not in NOT_IN_KEY}
    blob = json.dumps({"base": Path(base_model).name, "recipe": fields,
                       "version": RECIPE_VERSION}, sort_keys=True, default=list)
    return hashlib.blake2b(blob.encode(), digest_size=6).hexdigest()


def output_dir(base_model: str, recipe) -> Path:
    from rhyme_sglang.models import cache_dir

    return cache_dir() / f"warm-{recipe.task}-{cache_key(base_model, recipe)}"


# ---------------------------------------------------------------------------------- data
def encode_example(tokenizer, turns: List[Dict[str, str]]) -> Tuple[List[int], int]:
    """Token ids of a chat with its assistant turn, and the index of the first assistant token
    (loss is taken from there to the end: the answer and its ``<|im_end|>``)."""
    from rl_driver.tasks import chat_ids

    prompt, full = chat_ids(tokenizer, turns[:-1]), chat_ids(tokenizer, turns, False)
    if full[:len(prompt)] != prompt:
        raise ValueError("the chat template does not extend the prompt with the answer")
    while full and tokenizer.decode(full[-1:]).strip() == "":  # trailing newline after <|im_end|>
        full.pop()
    return full, len(prompt)


def build_examples(tokenizer, recipe) -> List[Tuple[List[int], int]]:
    from rl_driver.task_presets import chat, preset_entries

    entries = preset_entries(recipe.task, recipe.examples, recipe.seed + 10_000, recipe.sizes or None)
    return [encode_example(tokenizer, chat(recipe.task, e, with_answer=True)) for e in entries]


def micro_batches(examples: Sequence[Tuple[List[int], int]], batch_tokens: int,
                  rng: random.Random) -> List[List[int]]:
    """Indices of ``examples`` grouped by length (sorted), each group padded to its longest at
    most ``batch_tokens`` tokens; the groups in shuffled order."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    batches, cur = [], []
    for i in order:
        width = len(examples[i][0])
        if cur and width * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


# ---------------------------------------------------------------------------------- LoRA
def add_lora(model, rank: int, alpha: float, seed: int) -> List[Any]:
    """Wrap every ``LORA_TARGETS`` linear of the model's blocks with a rank-``rank`` adapter
    (``B @ A`` scaled by ``alpha / rank``, ``B`` zero so the model starts unchanged); freeze
    everything else. Returns the adapter modules."""
    import torch
    from torch import nn

    class LoRALinear(nn.Module):
        def __init__(self, base: nn.Linear, gen: torch.Generator):
            super().__init__()
            self.base = base
            self.scale = alpha / rank
            self.lora_a = nn.Parameter(torch.randn(rank, base.in_features, generator=gen)
                                       / math.sqrt(base.in_features))
            self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x):
            return self.base(x) + (x @ self.lora_a.t().to(x.dtype)) @ (
                self.lora_b.t().to(x.dtype) * self.scale)

    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    wrapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in LORA_TARGETS and isinstance(child, nn.Linear):
                lora = LoRALinear(child, gen)
                lora.path = f"{name}.{child_name}"
                setattr(module, child_name, lora)
                wrapped.append(lora)
    if not wrapped:
        raise ValueError(f"no linear layer named one of {LORA_TARGETS} to adapt")
    return wrapped


def adapter_state(wrapped) -> Dict[str, Any]:
    """The adapters as bf16 tensors, ``lora_b`` pre-scaled (what :func:`merge_adapter` reads)."""
    import torch

    state = {}
    for m in wrapped:
        state[f"{m.path}.lora_a"] = m.lora_a.detach().to(torch.bfloat16).contiguous()
        state[f"{m.path}.lora_b"] = (m.lora_b.detach() * m.scale).to(torch.bfloat16).contiguous()
    return state


def merge_adapter(model, state: Dict[str, Any]) -> int:
    """``W += B @ A`` for every adapted linear of ``state`` (``lora_b`` stored pre-scaled);
    returns how many were merged. A name the model lacks raises ValueError."""
    import torch

    modules = dict(model.named_modules())
    merged = 0
    for key in sorted(k for k in state if k.endswith(".lora_a")):
        path = key[: -len(".lora_a")]
        if path not in modules:
            raise ValueError(f"adapter entry {path!r} names no module of the model")
        weight = modules[path].weight
        with torch.no_grad():
            delta = state[f"{path}.lora_b"].float() @ state[key].float()
            weight.copy_((weight.float() + delta).to(weight.dtype))
        merged += 1
    return merged


# ------------------------------------------------------------------------------ training
def _progress(done: int, total: int, tokens: int, seconds: float, loss: float, tty: bool) -> None:
    rate = tokens / max(seconds, 1e-9)
    eta = (total - done) * seconds / max(done, 1)
    line = (f"warm start: step {done}/{total}, loss {loss:.3f}, {rate:.0f} tokens/s, "
            f"{seconds:.0f}s elapsed, ~{eta:.0f}s left")
    if tty:
        sys.stderr.write("\r" + line + ("\n" if done == total else ""))
        sys.stderr.flush()
    elif done == total or done % 10 == 0:
        print(line, flush=True)


def train_adapter(base_model: str, recipe, threads: Optional[int] = None) -> Dict[str, Any]:
    """Train the recipe's LoRA adapter on ``base_model``; returns ``{"state", "seconds",
    "tokens", "steps", "final_loss", "autocast_bf16"}``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rhyme_sglang import dtypes, machine

    torch.manual_seed(recipe.seed)
    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    examples = build_examples(tokenizer, recipe)
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.train()
    wrapped = add_lora(model, recipe.lora_rank, 2.0 * recipe.lora_rank, recipe.seed)
    params = [p for m in wrapped for p in (m.lora_a, m.lora_b)]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    rng = random.Random(recipe.seed)
    plan = [b for _ in range(recipe.epochs) for b in micro_batches(examples, recipe.batch_tokens, rng)]
    warmup = max(1, len(plan) // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.05, (len(plan) - s) / max(1, len(plan) - warmup))))
    autocast = dtypes.resolve_train_dtype() == "bfloat16"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tty = sys.stderr.isatty()
    t0, tokens, loss_ema = time.perf_counter(), 0, None
    for step, batch in enumerate(plan, 1):
        width = max(len(examples[i][0]) for i in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        targets = torch.full((len(batch), width), -100, dtype=torch.long)
        for r, i in enumerate(batch):
            seq, start = examples[i]
            ids[r, :len(seq)] = torch.tensor(seq)
            targets[r, start - 1:len(seq) - 1] = torch.tensor(seq[start:])
        rows, cols = (targets != -100).nonzero(as_tuple=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = model.model(input_ids=ids).last_hidden_state
            logits = model.lm_head(hidden[rows, cols])
        loss = torch.nn.functional.cross_entropy(logits.float(), targets[rows, cols])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += int(sum(len(examples[i][0]) for i in batch))
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        _progress(step, len(plan), tokens, time.perf_counter() - t0, loss_ema, tty)
    return {"state": adapter_state(wrapped), "seconds": time.perf_counter() - t0,
            "tokens": tokens, "steps": len(plan), "final_loss": loss_ema,
            "autocast_bf16": autocast, "examples": len(examples), "cpu": machine.cpu_model(),
            "cpu_flags": " ".join(machine.cpu_flags()), "threads": torch.get_num_threads()}


def save_merged(base_model: str, state: Dict[str, Any], folder: Path, info: Dict[str, Any]) -> Path:
    """Merge ``state`` into ``base_model`` and write the folder (atomically: a temporary
    sibling renamed into place), with ``adapter.safetensors`` and ``warm_start.json``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    merge_adapter(model, state)
    saved = json.loads((Path(base_model) / "config.json").read_text())
    dtype = getattr(torch, saved.get("torch_dtype") or saved.get("dtype") or "float32")
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(dtype).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(tmp)
    (tmp / "adapter").mkdir()
    save_file(state, str(tmp / ADAPTER_FILE))
    (tmp / "warm_start.json").write_text(json.dumps(info, indent=2, default=str))
    (tmp / ".complete").write_text("ok\n")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def shipped_adapter(base_model: str, recipe) -> Path:
    return ADAPTER_DIR / f"{recipe.task}-{cache_key(base_model, recipe)}.safetensors"


# ---------------------------------------------------------------------------- evaluation
def evaluate(model_path: str, recipe, max_new_tokens: int = 1024, dtype: str = "auto") -> Dict[str, Any]:
    """Held-out prompts x samples at temperature 1.0 on the project's engine (vanilla):
    ``{"accuracy", "mean_reward", "mean_length", "median_length", "max_length", "stopped",
    "samples", "seconds"}``."""
    import statistics

    from transformers import AutoTokenizer

    from rhyme_sglang import Engine
    from rl_driver.rewards import reasoning_gym_reward
    from rl_driver.task_presets import chat, preset_entries
    from rl_driver.tasks import Prompt, chat_ids

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    entries = preset_entries(recipe.task, recipe.eval_prompts, recipe.seed + 20_000,
                             recipe.sizes or None)
    prompts = []
    for i, e in enumerate(entries):
        prompts.append(Prompt(f"eval-{i}", chat_ids(tokenizer, chat(recipe.task, e)), e))
    engine = Engine(model_path=model_path, dtype=dtype, log_level="warning",
                    skip_tokenizer_init=True, max_total_tokens=32768)
    try:
        params = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": max_new_tokens}
        seeds = [recipe.seed * 1_000 + k for k in range(len(prompts) * recipe.eval_samples)]
        outs = engine.generate(
            input_ids=[p.token_ids for p in prompts for _ in range(recipe.eval_samples)],
            sampling_params=[dict(params, sampling_seed=s) for s in seeds])
    finally:
        engine.shutdown()
    rewards, lengths, stopped = [], [], 0
    for k, out in enumerate(outs):
        prompt = prompts[k // recipe.eval_samples]
        ids = out["output_ids"]
        rewards.append(reasoning_gym_reward(prompt, tokenizer.decode(ids), ids))
        lengths.append(len(ids))
        stopped += len(ids) < max_new_tokens
    return {"accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "mean_reward": sum(rewards) / len(rewards), "mean_length": statistics.mean(lengths),
            "median_length": statistics.median(lengths), "max_length": max(lengths),
            "stopped": stopped / len(outs), "samples": len(outs),
            "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------------------- the stage
def ensure(base_model: str, recipe, evaluate_after: bool = True, force_train: bool = False,
           log=print) -> Path:
    """The warm-started model folder for ``recipe`` on ``base_model``: the cached one, else
    the shipped adapter merged, else a trained one. Returns its path."""
    folder = output_dir(base_model, recipe)
    if (folder / ".complete").exists() and not force_train:
        return folder
    shipped = shipped_adapter(base_model, recipe)
    info: Dict[str, Any] = {"base_model": Path(base_model).name, "task": recipe.task,
                            "recipe": dataclasses.asdict(recipe), "key": cache_key(base_model, recipe)}
    if shipped.exists() and not force_train:
        from safetensors.torch import load_file

        log(f"warm start: merging the shipped adapter {shipped.name} into {Path(base_model).name}")
        meta_path = shipped.with_suffix(".json")
        if meta_path.exists():
            info.update({k: v for k, v in json.loads(meta_path.read_text()).items()
                         if k in ("training", "eval")}, source="shipped adapter")
        save_merged(base_model, load_file(str(shipped)), folder, info)
        return folder
    log(f"warm start: training {recipe.task} ({recipe.examples} examples, {recipe.epochs} "
        f"epoch(s), LoRA rank {recipe.lora_rank}, lr {recipe.lr}, seed {recipe.seed}) on "
        f"{Path(base_model).name}")
    result = train_adapter(base_model, recipe)
    state = result.pop("state")
    info.update(training=result, source="trained")
    log(f"warm start: trained in {result['seconds']:.0f}s, {result['tokens']} tokens "
        f"({result['tokens'] / result['seconds']:.0f} tokens/s), {result['steps']} steps, "
        f"final loss {result['final_loss']:.3f}, bf16 autocast {'on' if result['autocast_bf16'] else 'off'}")
    save_merged(base_model, state, folder, info)
    if evaluate_after and recipe.eval_prompts:
        ev = evaluate(str(folder), recipe)
        info["eval"] = ev
        (folder / "warm_start.json").write_text(json.dumps(info, indent=2, default=str))
        log(f"warm start: held-out eval ({ev['samples']} samples, T=1.0): accuracy "
            f"{ev['accuracy']:.2f}, mean reward {ev['mean_reward']:.2f}, length mean "
            f"{ev['mean_length']:.0f} / median {ev['median_length']:.0f} / max "
            f"{ev['max_length']}, {100 * ev['stopped']:.0f}% stop, {ev['seconds']:.0f}s")
    return folder


def policy_path(config, log=print) -> str:
    """The folder a run's policy starts from: ``config.model`` resolved, warm-started first
    when ``config.warm_start.enabled``."""
    from rhyme_sglang.models import resolve_model_path

    base = resolve_model_path(config.model)
    if not config.warm_start.enabled:
        return base
    return str(ensure(base, config.warm_start, log=log))


def export_adapter(folder: Path, recipe, base_model: str) -> Path:
    """Copy a trained folder's adapter (and its recipe, timing and eval) to ``ADAPTER_DIR``."""
    target = shipped_adapter(base_model, recipe)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(folder / ADAPTER_FILE, target)
    info = json.loads((folder / "warm_start.json").read_text())
    info["made_by"] = (f"python -m rl_driver.cli warm-start --task {recipe.task} "
                       f"--set warm_start.seed={recipe.seed} --force --export")
    target.with_suffix(".json").write_text(json.dumps(info, indent=2, default=str))
    return target
