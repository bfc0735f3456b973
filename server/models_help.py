"""``llmrpc serve --help=models``: which architectures (a config's ``architectures`` entry) this
build serves natively, which through Transformers' own code, and which it refuses, read from the
engine's table and from the Transformers installed beside it (each causal LM's class is imported
to ask whether its attention goes through Transformers' attention interface: a few seconds)."""

from __future__ import annotations

import textwrap

_ENCODER_NOTE = "an encoder: embeddings only (--runner pooling, one process, eager)"
_NATIVE_NOTES = {
    "MistralForCausalLM": "as Llama",
    "Phi3ForCausalLM": "Phi-3, Phi-3.5-mini, Phi-4-mini (longrope, partial rotary)",
    "Gemma2ForCausalLM": "Gemma 2 (local and global layers, attention soft-capping)",
    "Gemma3ForCausalLM": "Gemma 3 text (local and global layers)",
    "Gemma3ForConditionalGeneration": "its text model only (image inputs are refused)",
    "BertModel": _ENCODER_NOTE,
    "BertForMaskedLM": _ENCODER_NOTE,
    "BertForPreTraining": _ENCODER_NOTE,
}


def transformers_causal_lms() -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Transformers' causal-LM architectures, as (those whose attention goes through its
    attention interface, those that compute attention themselves, (name, why) of those whose
    class could not be imported here)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    paged, own, failed = [], [], []
    for name in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())):
        try:
            compatible = getattr(transformers, name).is_backend_compatible()
        except Exception as error:  # noqa: BLE001 - a missing optional dependency, reported
            failed.append((name, f"{type(error).__name__}: {error}".splitlines()[0][:120]))
            continue
        (paged if compatible else own).append(name)
    return paged, own, failed


def models_help(width: int = 100) -> str:
    from llmrpc.engine.models import NATIVE_MODELS

    paged, own, failed = transformers_causal_lms()
    paged = [name for name in paged if name not in NATIVE_MODELS]
    lines = [
        'Architectures (config.json\'s "architectures") and how this build serves them.',
        "",
        "Native: our implementation; the decoders on the paged KV cache with the engine's "
        "features (packed CPU kernels and -q, Triton on CUDA, -O and CUDA graphs, LoRA, tensor "
        "parallelism, speculative decoding):",
    ]
    for name in NATIVE_MODELS:
        note = _NATIVE_NOTES.get(name, "")
        lines.append(f"  {name:30} {note}".rstrip())
    lines += [
        "",
        f"Through Transformers' own code ({len(paged)}; --model-impl auto takes it where no "
        "native one exists, --model-impl transformers always): its causal LM over our paged KV "
        "cache, eager (no -O or CUDA graphs), its linear layers through torch (the tests run "
        "GPT-2, OPT and Llama this way). A model whose "
        "layers are not all attention (recurrent or hybrid) stops at its first forward pass, "
        "saying so:",
        *_columns(paged, width),
        "",
        "Refused at start-up, naming the reason: a config of a type Transformers has no causal "
        f"LM for (encoder-decoder, vision and the like), and these {len(own)} causal LMs whose "
        "attention "
        "Transformers computes itself, outside its attention interface, so it cannot use our "
        "KV cache:",
        *_columns(own, width),
    ]
    if failed:
        lines += ["", "Not checked here (their Transformers class did not import):"]
        lines += [f"  {name}: {why}" for name, why in failed]
    wrapped = []
    for line in lines:
        if line.startswith("  "):
            wrapped.append(line)
        else:
            wrapped.extend(textwrap.wrap(line, width) or [""])
    return "\n".join(wrapped) + "\n"


def _columns(names: list[str], width: int) -> list[str]:
    """``names`` in as many columns as fit ``width``, filled down each column."""
    if not names:
        return ["  (none)"]
    cell = max(map(len, names)) + 2
    per_line = max(1, (width - 2) // cell)
    num_lines = -(-len(names) // per_line)
    return [
        "  " + "".join(f"{names[i]:{cell}}" for i in range(row, len(names), num_lines)).rstrip()
        for row in range(num_lines)
    ]
