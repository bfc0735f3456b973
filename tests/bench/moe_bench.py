"""The Mixture-of-Experts measurements (not part of ``make test``; ``make bench-moe`` runs both).

``save DIR``: a Mixtral-shaped model of random weights, 8 experts and top-2 in every layer,
SmolLM2-135M's sizes otherwise (30 layers, hidden 576, expert intermediate 1536, 9 heads, 3 KV
heads), in bfloat16 with the packaged SmolLM2's tokenizer, for ``llmrpc bench throughput --model
DIR --baseline transformers``.

``layer``: a MoE block (router, 8 experts, top-2) against the dense SiLU MLP of the same active
parameters (intermediate 2 x 1536), both as the engine serves them on this CPU (bfloat16, the
linear kernels measured fastest here, packed), at 1 to 512 rows of random hidden states: the
median of interleaved timings of each, and their ratio. Each timing runs 30 blocks of a kind one
after another, as a step runs its layers, so that their weights come from memory (a block timed
alone would find the dense MLP's 10 MB in the cache and its 4x larger experts not). Routing is
whatever the random router gives, so the experts' loads are uneven as in a real step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 576, 1536, 8, 2
ROWS = (1, 8, 32, 128, 512)
COPIES = 30  # a SmolLM2-sized model's layers: the dense ones 318 MB, past any cache


def save(out_dir: Path) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    from llmrpc.engine.loading.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None))
    config = MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True, sliding_window=None,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # routers of spread logits, so every expert gets tokens
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, HIDDEN**-0.5)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"saved to {out_dir}")


def layer(rounds: int) -> None:
    from llmrpc.engine.models.llama import LlamaMLP
    from llmrpc.engine.models.moe import SparseMoeBlock, unstack_experts
    from llmrpc.kernels.linear import pack_linear_layers
    from llmrpc.kernels.linear_tuning import layouts, plan_linear_kernels

    config = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=2 * INTERMEDIATE,
                             num_experts_per_tok=TOP_K)  # fmt: skip
    torch.manual_seed(0)
    moe, dense = torch.nn.ModuleList(), torch.nn.ModuleList()
    for _ in range(COPIES):
        moe.append(SparseMoeBlock(config, EXPERTS, INTERMEDIATE, renormalize=True))
        torch.nn.init.normal_(moe[-1].gate.weight, std=HIDDEN**-0.5)
        dense.append(LlamaMLP(config))
        torch.nn.init.normal_(dense[-1].gate_up_proj.weight, std=0.02)
        torch.nn.init.normal_(dense[-1].down_proj.weight, std=0.02)
    models = torch.nn.ModuleDict({"moe": moe, "dense": dense}).to(torch.bfloat16).eval()
    unstack_experts(models)
    cache = Path.home() / ".cache" / "llmrpc" / "kernels"
    pack_linear_layers(models, layouts(plan_linear_kernels(models, cache)))
    print(f"threads {torch.get_num_threads()}; {COPIES} blocks a timing, median of {rounds} "
          "interleaved rounds, ms per block")  # fmt: skip
    print(f"{'rows':>5} {'moe':>8} {'dense':>8} {'moe/dense':>10}")
    with torch.no_grad():
        for rows in ROWS:
            x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16)
            times = {"moe": [], "dense": []}
            for _ in range(rounds + 2):  # the first two warm up
                for name, blocks in (("moe", moe), ("dense", dense)):
                    start = time.perf_counter()
                    for block in blocks:
                        block(x)
                    times[name].append((time.perf_counter() - start) / COPIES)
            medians = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
            ratio = medians["moe"] / medians["dense"]
            print(f"{rows:>5} {medians['moe']:>8.3f} {medians['dense']:>8.3f} {ratio:>10.2f}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("save").add_argument("out_dir", type=Path)
    commands.add_parser("layer").add_argument("--rounds", type=int, default=50)
    args = parser.parse_args(argv)
    if args.command == "save":
        save(args.out_dir)
    else:
        layer(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
