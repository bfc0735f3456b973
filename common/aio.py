"""asyncio helpers shared by the server and the gateway."""

from __future__ import annotations

import asyncio


async def gather_or_cancel(*awaitables) -> list:
    """``asyncio.gather`` that cancels the others when one fails (no TaskGroup on 3.10): a call
    whose parts each hold an engine request aborts them all when one part fails."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
