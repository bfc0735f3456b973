"""What several layers share and none owns: the command lines' parser (one-line usage errors that
name the closest flag), and the flag values both the gRPC server and the REST gateway take (chat
template files or text, TLS certificate files), read and checked once so ``llmrpc serve`` and
``llmrpc gateway`` say the same thing about the same mistake. Imports nothing else of llmrpc.
"""
