"""vLLM's engine service as the smg router calls it (packages ``vllm.grpc.engine`` and
``smg.grpc.common``): generated stubs only."""
