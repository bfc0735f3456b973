"""Sampling: the per-request logits rules applied before it, and the sampler (greedy, temperature,
top-k/p, min-p, one RNG per request). Imports torch."""
