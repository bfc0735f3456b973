"""A pytest plugin for the device check's dry run: keeps the first ``$LLMRPC_DEVICE_SAMPLE`` tests
of each file (2 by default) and deselects the rest, so the dry run proves each stage's imports,
fixtures and exit codes in seconds, not the whole CPU suite again."""

from __future__ import annotations

import os


def pytest_collection_modifyitems(config, items):
    keep_per_file = int(os.environ.get("LLMRPC_DEVICE_SAMPLE", "2"))
    kept, dropped, seen = [], [], {}
    for item in items:
        count = seen.get(item.fspath, 0)
        (kept if count < keep_per_file else dropped).append(item)
        seen[item.fspath] = count + 1
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
