"""Speculative decoding: ``--speculative-config``, the n-gram and draft-model proposers and their
back-off. Imports no torch: the draft model's runner is built by the engine core, and
verification is the core's, with its sampler."""
