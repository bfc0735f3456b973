"""Flag values that both the gRPC server and the REST gateway take: chat template files or text,
and TLS certificate files. One reading and one check each, so ``llmrpc serve`` and
``llmrpc gateway`` say the same thing about the same mistake. Imports nothing else of llmrpc.
"""
