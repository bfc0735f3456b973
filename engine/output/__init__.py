"""Outputs: per-request output state (its seeded RNG a torch.Generator), incremental
detokenization and stop strings. Nothing here knows how a step runs."""
