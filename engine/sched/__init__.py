"""Scheduling: the token-budget scheduler, the fair waiting queues and the paged KV cache's
bookkeeping (block pool, prefix cache). Pure Python: imports no torch and no runner."""
