"""Speculative decoding: ``--speculative-config``, the n-gram proposer and its back-off. Pure
Python and numpy: imports no torch (verification is the engine core's, with its sampler)."""
