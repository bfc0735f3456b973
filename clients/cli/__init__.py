"""The command-line client: ``llmrpc generate``, ``chat``, ``tokenize`` and ``admin``.

Each verb is a module with ``main(argv)``, dispatched by ``llmrpc.server.cli``; none imports
torch or the engine, so they start fast.
"""
