"""``llmrpc bench throughput``: the engine's offline throughput in this process, optionally
against Transformers (``DESCRIPTION`` says how it measures). ``llmrpc bench``, in the clients,
which never import the engine, hands this mode to ``main`` by module name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from llmrpc.common.args import OneLineErrorParser
from llmrpc.common.sharegpt import first_human_turns
from llmrpc.engine import roofline
from llmrpc.engine.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    QUANTIZATION_METHODS,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.core_types import SpecDecodeCounts
from llmrpc.engine.lora.types import LoRAConfig
from llmrpc.engine.parallel.config import ParallelConfig
from llmrpc.engine.quantization.layers import QuantizedLinear
from llmrpc.engine.request import SamplingParams, StructuredOutputSpec
from llmrpc.engine.runner.model_runner import kv_bytes_per_block
from llmrpc.engine.spec_decode.config import SpeculativeConfig
from llmrpc.kernels.linear import BlockedLinear, PackedLinear

_WARMUP_OUTPUT_LEN = 4

DESCRIPTION = """\
Offline throughput of the engine in this process, no server: every prompt is queued at once
and the engine steps until all are done (continuous batching under its token budget).

With --baseline transformers the same prompts also run through Transformers' static-batch
generate() on the same weights and dtype, in the same process, and the ratio of output-token
throughputs is printed. Prompts are random token ids of exactly --input-len tokens and outputs
exactly --output-len tokens (EOS ignored; min_new_tokens for Transformers), greedy on both
sides, so both do the same work.

With --json-schema FILE, --structured-fraction of the prompts (every other one by default) are
held to that schema (EOS still ignored: past the schema's end they may only repeat a stop token),
and --baseline free runs the same prompts on the same engine with none held, so the ratio is
the cost of structured output. The schema's compile time (against the vocabulary, uncached) is
printed too.

With --lora-modules NAME=PATH... every prompt uses one of those LoRA adapters, in turn (with 4
adapters and 32 prompts, one batch mixes 4 adapters, 8 prompts each), and --baseline free runs
the same prompts on the same engine with no adapter: the ratio is the cost of multi-LoRA.

With --speculative-config JSON the engine speculates as `llmrpc serve` would, the table says
how many drafts it verified, the share accepted and the mean tokens a verify step gave, and
--baseline free runs the same prompts on the same engine without speculation: the ratio is
its speed-up. --dataset FILE (ShareGPT format) takes the first human turns of that file instead
of random prompts, through the model's chat template, greedy, each ending at EOS or
--output-len tokens: text whose answer repeats it (an edit, a summary) is where speculation
pays.

Each side first runs the same batch shape untimed, on other prompts and a few output tokens:
PyTorch's CPU kernels pay a large one-time cost for each new shape, which is not throughput.
With --repeats N the sides take turns N times and each keeps its fastest run, so a burst of
load from other processes on a shared machine skews the ratio less. The engine's prefix cache
is reset before each run: a repeat must not find its prompts cached.
"""
# Random prompts leave out the first token ids, where tokenizers keep their special tokens (as
# ``llmrpc bench serve``'s random prompts do).
_FIRST_ORDINARY_TOKEN = 100
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="llmrpc bench throughput",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Model folder or .gguf (default: the packaged SmolLM2).")
    parser.add_argument("--dtype", default="auto", help="As in `llmrpc serve` (default auto).")
    parser.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATION_METHODS,
        help="As in `llmrpc serve`, for the engine (a Transformers baseline runs unquantized).",
    )
    parser.add_argument(
        "-O",
        "--compilation-config",
        type=_compilation,
        default=CompilationConfig(),
        metavar="LEVEL|JSON",
        help="As in `llmrpc serve` (default 0: eager).",
    )
    parser.add_argument(
        "--device", choices=DEVICES, default="auto", help="As in `llmrpc serve` (default auto)."
    )
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="As in `llmrpc serve` (default auto).",
    )
    parser.add_argument(
        "--batch-invariant", action="store_true", help="As in `llmrpc serve`, for the engine."
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="As in `llmrpc serve`."
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random prompts.")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="As in `llmrpc serve`.")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", type=float, default=4.0, help="GiB for the cache.")
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, help="As in `llmrpc serve`."
    )
    parser.add_argument(
        "--baseline",
        choices=("transformers", "free"),
        help="Also run this baseline and print the ratio (free: no --json-schema, no adapter).",
    )
    parser.add_argument("--json-schema", type=Path, help="Hold prompts to this JSON schema file.")
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help="PEFT LoRA adapters; the prompts use them in turn (--enable-lora, as in serve).",
    )
    parser.add_argument(
        "--max-lora-rank", type=int, default=16, help="As in `llmrpc serve` (default 16)."
    )
    parser.add_argument(
        "--structured-fraction",
        type=float,
        default=0.5,
        help="With --json-schema: the fraction of prompts held to it (default 0.5).",
    )
    parser.add_argument(
        "--baseline-batch-size",
        type=int,
        help="Prompts per Transformers generate() call (default: all of them in one batch).",
    )
    parser.add_argument(
        "--speculative-config",
        type=_speculative,
        default=SpeculativeConfig(),
        metavar="JSON",
        help="As in `llmrpc serve` (default: none).",
    )
    parser.add_argument(
        "--dataset",
        type=Path,
        help="A ShareGPT-format JSON file: its first human turns, through the chat template, "
        "instead of random prompts (EOS then ends an output).",
    )
    parser.add_argument("--repeats", type=int, default=1, help="Runs per side; the best counts.")
    parser.add_argument(
        "--roofline",
        action="store_true",
        help="Also measure this machine's read bandwidth on the engine's threads and print the "
        "decode rate it bounds (weights read once a step, each sequence's KV cache once) beside "
        "the engine's decode rate (from the step where every prompt has its first token).",
    )
    parser.add_argument("--output-json", type=Path, help="Write the results here as JSON.")


def _compilation(text: str) -> CompilationConfig:
    """``-O3`` or a JSON object, checked as ``llmrpc serve`` checks it."""
    try:
        return CompilationConfig(
            {"level": int(text)} if text.strip().isdigit() else json.loads(text)
        )
    except ValueError as error:  # json.JSONDecodeError is one
        raise argparse.ArgumentTypeError(str(error)) from None


def _speculative(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig(json.loads(text))
    except ValueError as error:  # json.JSONDecodeError is one
        raise argparse.ArgumentTypeError(str(error)) from None


class EngineSide:
    """The engine core, driven step by step in this thread."""

    def __init__(self, args: argparse.Namespace, core: EngineCore | None = None) -> None:
        """With ``core``: that engine, free of any schema (``--baseline free``)."""
        self.name = "engine" if core is None else "free"
        self.structured = None
        # the engine side's requests take these adapters in turn; the free side's none
        self.adapters = [m.split("=")[0] for m in args.lora_modules or ()] if core is None else []
        self.fraction = args.structured_fraction
        self.decode_rates = []
        if core is not None:
            self.core = core
            self._num_runs = 0
            return
        self.core = EngineCore(
            EngineConfig(
                model=ModelConfig(
                    model=args.model,
                    dtype=args.dtype,
                    quantization=args.quantization,
                    device=args.device,
                    attention_backend=args.attention_backend,
                    batch_invariant=args.batch_invariant,
                ),
                cache=CacheConfig(
                    kv_cache_memory_gib=args.kv_cache_memory,
                    gpu_memory_utilization=args.gpu_memory_utilization,
                ),
                compilation=args.compilation_config,
                scheduler=SchedulerConfig(
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                ),
                lora=LoRAConfig(
                    enabled=bool(self.adapters),
                    max_loras=max(len(self.adapters), 1),  # every adapter in every step
                    max_lora_rank=args.max_lora_rank,
                    lora_modules=tuple(args.lora_modules or ()),
                ),
                parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
                speculative=args.speculative_config,
            )
        )
        self._num_runs = 0
        self.decode_rates: list[float] = []  # output tokens/s past every prompt's first, a run

    def hold_to(self, schema_file: Path) -> float:
        """Hold a fraction of the prompts to this schema; returns its compile time in seconds."""
        spec = StructuredOutputSpec("json_schema", schema_file.read_text(), any_whitespace=False)
        self.core.grammar_compiler.warmed.result()
        start = time.perf_counter()
        backend = self.core.structured_config.backend
        self.structured, _ = self.core.grammar_compiler.submit(spec, backend).result()
        return time.perf_counter() - start

    def run(self, prompts: list[list[int]], output_len: int, ignore_eos: bool = True) -> int:
        """Queue every prompt, step until all finish; the number of output tokens."""
        self.core.reset_prefix_cache()
        # the free side of --speculative-config: the same engine, no proposals
        proposer = self.core.scheduler.proposer
        if self.name == "free":
            self.core.scheduler.proposer = None
        try:
            return self._run(prompts, output_len, ignore_eos)
        finally:
            self.core.scheduler.proposer = proposer

    def _run(self, prompts: list[list[int]], output_len: int, ignore_eos: bool) -> int:
        self._num_runs += 1
        held = 0
        for index, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos)
            if self.structured is not None and held < self.fraction * (index + 1):
                params.structured_output, held = self.structured, held + 1
            if self.adapters:
                params.lora_name = self.adapters[index % len(self.adapters)]
            self.core.add_request(f"run{self._num_runs}-{index}", prompt, params)
        num_output_tokens = 0
        started: set[str] = set()
        decode_from: tuple[float, int] | None = None  # when every prompt had a token, and count
        while self.core.has_unfinished_requests:
            outputs = self.core.step()
            num_output_tokens += sum(len(output.token_ids) for output in outputs)
            if decode_from is None:
                started.update(output.request_id for output in outputs if output.token_ids)
                if len(started) == len(prompts):
                    decode_from = (time.perf_counter(), num_output_tokens)
        if decode_from is not None and num_output_tokens > decode_from[1]:
            elapsed = time.perf_counter() - decode_from[0]
            self.decode_rates.append((num_output_tokens - decode_from[1]) / elapsed)
        return num_output_tokens


class TransformersSide:
    """Transformers' greedy static-batch ``generate``, ``batch_size`` prompts per call."""

    name = "transformers"

    def __init__(self, model_dir: Path, dtype, batch_size: int | None, device) -> None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model = model.to(device).eval()
        self.device = device
        self.batch_size = batch_size

    def run(self, prompts: list[list[int]], output_len: int, ignore_eos: bool = True) -> int:
        if not ignore_eos:
            raise ValueError("--baseline transformers runs random prompts only, not --dataset")
        size = self.batch_size or len(prompts)
        num_tokens = sum(
            self._generate(prompts[i : i + size], output_len) for i in range(0, len(prompts), size)
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the run ends when the device is done
        return num_tokens

    def _generate(self, batch: list[list[int]], num_tokens: int) -> int:
        # [batch, input_len]: equal lengths, no padding
        input_ids = torch.tensor(batch, device=self.device)
        with torch.inference_mode():
            output = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,  # EOS suppressed: exactly num_tokens, as ignore_eos
                do_sample=False,
                pad_token_id=self.model.config.eos_token_id,
            )
        return (output.shape[1] - input_ids.shape[1]) * input_ids.shape[0]


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num_prompts`` prompts of exactly ``input_len`` random ordinary token ids."""
    if vocab_size <= _FIRST_ORDINARY_TOKEN:
        raise ValueError(f"vocabulary of {vocab_size} tokens is too small for random prompts")
    rng = random.Random(seed)
    return [
        [rng.randrange(_FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(input_len)]
        for _ in range(num_prompts)
    ]


def dataset_prompts(tokenizer, path: Path, num_prompts: int, seed: int) -> list[list[int]]:
    """The first human turns of a ShareGPT file, each the user's message in the chat template."""
    turns = first_human_turns(path, num_prompts, seed)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}], tokenize=False, add_generation_prompt=True
        )
        for turn in turns
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def _acceptance(before, after) -> dict:
    """The speculative counts of the measured runs (``SpecDecodeCounts``, ``after`` less
    ``before``)."""
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    run = SpecDecodeCounts(drafts, draft_tokens, accepted, ())
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": run.acceptance_rate,
        "mean_accepted_length": run.mean_accepted_length,
    }


def _linear(module) -> bool:
    """A linear layer as the engine computes it: plain, packed (ours or oneDNN's), or quantized."""
    return isinstance(module, (torch.nn.Linear, BlockedLinear, PackedLinear, QuantizedLinear))


def _figures(num_requests: int, input_tokens: int, output_tokens: int, elapsed: float) -> dict:
    return {
        "elapsed_s": elapsed,
        "requests": num_requests,
        "output_tokens": output_tokens,
        "request_throughput": num_requests / elapsed,
        "output_throughput": output_tokens / elapsed,
        "total_token_throughput": (input_tokens + output_tokens) / elapsed,
    }


def warm_up(sides: list, warmup_prompts) -> None:
    for side in sides:
        side.run(warmup_prompts, _WARMUP_OUTPUT_LEN)


def measure(sides: list, prompts, output_len: int, repeats: int, ignore_eos: bool = True) -> dict:
    """Each side's figures from its fastest of ``repeats`` runs, the sides taking turns."""
    best: dict[str, tuple[float, int]] = {}
    for _ in range(repeats):
        for side in sides:
            start = time.perf_counter()
            num_output_tokens = side.run(prompts, output_len, ignore_eos)
            elapsed = time.perf_counter() - start
            if side.name not in best or elapsed < best[side.name][0]:
                best[side.name] = (elapsed, num_output_tokens)
    input_tokens = sum(len(prompt) for prompt in prompts)
    return {
        name: _figures(len(prompts), input_tokens, tokens, elapsed)
        for name, (elapsed, tokens) in best.items()
    }


def format_table(results: dict) -> str:
    rows = [("", "req/s", "output tok/s", "total tok/s", "seconds")]
    for name in ("engine", "transformers", "free"):
        if name in results:
            r = results[name]
            rows.append(
                (
                    name,
                    f"{r['request_throughput']:.2f}",
                    f"{r['output_throughput']:.1f}",
                    f"{r['total_token_throughput']:.1f}",
                    f"{r['elapsed_s']:.2f}",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    baseline = "free" if "free" in results else "transformers"
    if "ratio" in results:
        lines.append(f"engine / {baseline} output throughput: {results['ratio']:.2f}x")
    if "schema_compile_ms" in results:
        lines.append(f"JSON schema compile: {results['schema_compile_ms']:.1f} ms")
    spec = results.get("speculative")
    if spec is not None:
        lines.append(
            f"speculative decoding (engine): {spec['num_drafts']} proposals, "
            f"{spec['num_accepted_tokens']} of {spec['num_draft_tokens']} draft tokens accepted "
            f"({spec['acceptance_rate']:.1%}), {spec['mean_accepted_length']:.2f} tokens a "
            "verify step"
        )
    return "\n".join(lines)


def _roofline(engine: EngineSide, args: argparse.Namespace) -> dict:
    """Print the roofline line for this run's decode steps; its figures for the JSON."""
    core = engine.core
    if core.device.type != "cpu":
        raise ValueError(
            f"--roofline measures a CPU's read bandwidth; this engine runs on {core.device.type}"
        )
    bound = roofline.Roofline(
        bandwidth=roofline.read_bandwidth(),
        threads=torch.get_num_threads(),
        weight_bytes=roofline.weight_bytes_per_step(core.model),
        kv_bytes_per_token=kv_bytes_per_block(core.hf_config, 1, core.kv_cache_dtype),
        batch=min(args.num_prompts, args.max_num_seqs),
        context=args.input_len + args.output_len / 2,
    )
    measured = max(engine.decode_rates, default=0.0)
    print(bound.line(measured))
    return {
        **dataclasses.asdict(bound),
        "step_bytes": bound.step_bytes,
        "roofline_tokens_per_second": bound.tokens_per_second,
        "decode_tokens_per_second": measured,
        "fraction": measured / bound.tokens_per_second,
    }


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = run(args)
    except (ValueError, FileNotFoundError, PermissionError, IsADirectoryError) as error:
        print(f"llmrpc: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    # End here, without the interpreter's teardown: after an -O3 run, a compile worker's C++
    # thread destroyed at exit while still joinable aborted the process (-6) after its results.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(args: argparse.Namespace) -> int:
    speculates = args.speculative_config.enabled
    if args.baseline == "free" and not (args.json_schema or args.lora_modules or speculates):
        raise ValueError(
            "--baseline free compares against --json-schema, --lora-modules or --speculative-config"
        )
    engine = EngineSide(args)
    core = engine.core
    sides = [engine]
    compile_s = engine.hold_to(args.json_schema) if args.json_schema else None
    if args.baseline == "transformers":
        sides.append(
            TransformersSide(core.model_dir, core.dtype, args.baseline_batch_size, core.device)
        )
    elif args.baseline == "free":
        sides.append(EngineSide(args, core))
    vocab_size = core.hf_config.vocab_size
    prompts, warmup_prompts = (
        random_prompts(args.num_prompts, args.input_len, vocab_size, seed)
        for seed in (args.seed, args.seed + 1)
    )
    if args.dataset is not None:
        prompts = dataset_prompts(core.tokenizer, args.dataset, args.num_prompts, args.seed)
    warm_up(sides, warmup_prompts)
    spec_before = core.proposer.stats.counts() if speculates else None
    ignore_eos = args.dataset is None
    results = measure(sides, prompts, args.output_len, args.repeats, ignore_eos)
    if speculates:
        results["speculative"] = _acceptance(spec_before, core.proposer.stats.counts())
    baseline = sides[1].name if len(sides) > 1 else None
    if baseline is not None:
        ratio = results["engine"]["output_throughput"] / results[baseline]["output_throughput"]
        results["ratio"] = ratio
    if compile_s is not None:
        results["schema_compile_ms"] = compile_s * 1000
    results["config"] = {
        **{k: v for k, v in vars(args).items() if k not in ("output_json", "compilation_config")},
        "compilation_level": core.compilation.level,
        "compiled": core.runner.compiled_decode is not None,
        "dtype": str(core.dtype).removeprefix("torch."),
        "device": str(core.device),
        "attention_backend": core.attention_backend,
        "layers": dict(Counter(type(m).__name__ for m in core.model.modules() if _linear(m))),
        "model_dir": str(core.model_dir),
    }
    print(format_table(results))
    if args.roofline:
        results["roofline"] = _roofline(engine, args)
    if args.output_json:
        args.output_json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0
