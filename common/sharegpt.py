"""ShareGPT-format prompt files, as both benchmarks read them: a JSON list of
``{"conversations": [{"from": "human", "value": ...}, ...]}``."""

from __future__ import annotations

import json
import random
from pathlib import Path


def first_human_turns(path: str | Path, num_prompts: int, seed: int) -> list[str]:
    """``num_prompts`` first human turns of the file, sampled with ``seed``. Conversations
    whose first turn is not a non-empty human turn are skipped."""
    conversations = json.loads(Path(path).read_text(encoding="utf-8"))
    prompts = [
        turns[0]["value"]
        for entry in conversations
        if (turns := entry.get("conversations"))
        and turns[0].get("from") == "human"
        and turns[0].get("value", "").strip()
    ]
    if len(prompts) < num_prompts:
        raise ValueError(
            f"{path}: {len(prompts)} usable conversations, fewer than --num-prompts {num_prompts}"
        )
    return random.Random(seed).sample(prompts, num_prompts)
