"""PEFT LoRA adapters from a local folder (``adapter_config.json`` + ``adapter_model.safetensors``):
read, checked against what the engine serves, and turned into per-module ``(A, B)`` pairs with the
scaling folded into ``B`` (and into ``lora_B``'s bias, which PEFT's forward scales too).

Anything the engine would serve wrongly is refused with ``InvalidRequestError`` naming why:
DoRA, ``modules_to_save``, trained base biases, rank or alpha patterns, embedding or ``lm_head``
targets, a rank over ``--max-lora-rank``, shapes of another model.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from llmrpc.engine.request import InvalidRequestError

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 2**20
WEIGHTS_FILE = "adapter_model.safetensors"
# the checkpoint names of the projections the engine serves LoRA on
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a checkpoint whose projections come fused (Phi-3): its adapters target the fused module, whose
# lora_B is the slices' B one above the other, over one lora_A
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_KEY = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.("
    + "|".join((*TARGET_MODULES, *FUSED_MODULES))
    + r")\.lora_([AB])\.(weight|bias)$"
)
_FIELD = "lora_path"  # the request field a bad adapter is charged to


@dataclass
class LoRAWeights:
    """One module's adapter: ``a [r, in]``, ``b [out, r]`` already scaled, ``bias [out]``."""

    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor | None = None


@dataclass
class LoRAAdapter:
    """A loaded adapter: its rank and the weights of every module it adapts."""

    rank: int
    scaling: float
    modules: dict[tuple[int, str], LoRAWeights]  # (layer index, checkpoint module name)

    @property
    def nbytes(self) -> int:
        return sum(
            w.a.nbytes + w.b.nbytes + (0 if w.bias is None else w.bias.nbytes)
            for w in self.modules.values()
        )


def _refuse(message: str) -> InvalidRequestError:
    return InvalidRequestError(_FIELD, message)


def read_config(folder: Path) -> dict:
    """The folder's adapter config. A path that is not a folder holding both files gets one
    answer whatever it is (missing, a file, another folder), so a caller cannot map the
    server's filesystem through the load call; the server's log says which it was."""
    config_path = folder / CONFIG_FILE
    try:
        is_adapter = config_path.is_file() and (folder / WEIGHTS_FILE).is_file()
    except OSError:  # a name too long, a loop of links...
        is_adapter = False
    if not is_adapter:
        logger.info("LoRA load: %s lacks %s or %s", folder, CONFIG_FILE, WEIGHTS_FILE)
        raise _refuse(
            f"{str(folder)!r} is not a loadable LoRA adapter folder (a folder on the server "
            f"holding {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    try:
        with config_path.open("rb") as file:
            text = file.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise _refuse(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes (PEFT's are a few KB)")
        config = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _refuse(f"{CONFIG_FILE} cannot be read: {error}") from None
    except RecursionError:
        raise _refuse(f"{CONFIG_FILE} is nested too deeply to be a PEFT config") from None
    if not isinstance(config, dict):
        raise _refuse(f"{CONFIG_FILE} is not a JSON object")
    return config


def check_config(config: dict, max_rank: int, enable_bias: bool) -> tuple[int, float]:
    """``(rank, scaling)`` of a supported LoRA config; refuses the rest, naming why."""
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    refusals = (
        ("use_dora", "DoRA adapters (use_dora) are not supported"),
        ("modules_to_save", "modules_to_save (fully trained layers) are not supported"),
        ("rank_pattern", "per-module ranks (rank_pattern) are not supported"),
        ("alpha_pattern", "per-module alphas (alpha_pattern) are not supported"),
        ("layer_replication", "layer_replication is not supported"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D weights) is not supported"),
    )
    for key, message in refusals:
        if config.get(key):
            raise _refuse(message)
    if config.get("bias", "none") != "none":
        raise _refuse(f"bias={config['bias']!r} (trained base-layer biases) is not supported")
    if config.get("lora_bias") and not enable_bias:
        raise _refuse("the adapter has lora_B biases; start the server with --enable-lora-bias")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if type(rank) is not int or rank < 1:
        raise _refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _refuse(f"rank {rank} is over --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise _refuse(f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def load_adapter(
    path: str,
    max_rank: int,
    enable_bias: bool,
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Read and check the adapter at ``path``. ``shapes``: each target module's ``(in, out)``
    features in the served model, which has ``num_layers`` layers."""
    folder = Path(path)
    rank, scaling = check_config(read_config(folder), max_rank, enable_bias)
    try:
        tensors = load_file(folder / WEIGHTS_FILE)
    except (OSError, SafetensorError) as error:
        raise _refuse(f"{WEIGHTS_FILE} cannot be read: {error}") from None
    served = [*shapes, *(f for f, names in FUSED_MODULES.items() if set(names) <= set(shapes))]
    why = "" if len(shapes) == len(TARGET_MODULES) else "; a MoE model's MLPs take no adapters"
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in served:
            raise _refuse(
                f"weight {key!r} adapts a module this engine does not serve LoRA on (only "
                f"{', '.join(served)} of the decoder layers{why})"
            )
        layer, module, side, kind = match.groups()
        if int(layer) >= num_layers:
            raise _refuse(f"weight {key!r}: the model has {num_layers} layers")
        parts.setdefault((int(layer), module), {})[side + kind] = tensor
    if not parts:
        raise _refuse(f"{WEIGHTS_FILE} holds no LoRA weights")
    parts = _split_fused(parts, shapes)
    modules = {
        key: _module_weights(key, part, rank, scaling, shapes[key[1]], dtype)
        for key, part in parts.items()
    }
    return LoRAAdapter(rank, scaling, modules)


def _split_fused(parts: dict, shapes: dict[str, tuple[int, int]]) -> dict:
    """A fused module's adapter as its slices' (each slice: the one lora_A, its rows of lora_B);
    a fused module and one of its slices both adapted in one layer is refused."""
    split = {}
    for (layer, module), part in parts.items():
        slices = FUSED_MODULES.get(module)
        if slices is None:
            split.setdefault((layer, module), {}).update(part)
            continue
        start = 0
        for name in slices:
            if (layer, name) in parts:
                raise _refuse(f"layer {layer}: both {module} and its slice {name} are adapted")
            rows = shapes[name][1]
            split[(layer, name)] = {
                side: tensor if side.startswith("A") else tensor[start : start + rows]
                for side, tensor in part.items()
            }
            start += rows
        b = part.get("Bweight")
        if b is not None and b.shape[0] != start:
            raise _refuse(
                f"layer {layer} {module}: lora_B has {b.shape[0]} rows, the model's {module} "
                f"{start} (an adapter of another model?)"
            )
    return split


def _module_weights(key, part, rank: int, scaling: float, shape, dtype) -> LoRAWeights:
    name = f"layer {key[0]} {key[1]}"
    a, b = part.get("Aweight"), part.get("Bweight")
    if a is None or b is None or "Abias" in part:
        raise _refuse(f"{name}: lora_A.weight and lora_B.weight expected, got {sorted(part)}")
    in_features, out_features = shape
    if a.shape != (rank, in_features) or b.shape != (out_features, rank):
        raise _refuse(
            f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit rank "
            f"{rank} on a {in_features} -> {out_features} layer (an adapter of another model?)"
        )
    bias = part.get("Bbias")
    if bias is not None and bias.shape != (out_features,):
        raise _refuse(f"{name}: lora_B.bias {tuple(bias.shape)}, expected ({out_features},)")
    # scaled in float32, then rounded once to the serving dtype
    return LoRAWeights(
        a=a.to(dtype),
        b=(b.float() * scaling).to(dtype),
        bias=None if bias is None else (bias.float() * scaling).to(dtype),
    )
