"""Tensor parallelism: one model sharded over several processes (``--tensor-parallel-size``).

``config`` is read by the frontend and must stay free of torch; ``layers`` shards a loaded
native Llama-family model, ``executor`` (rank 0, in the engine process) and ``worker`` (ranks
1..N-1) run it.
"""
