"""The continuous-batching engine: knows nothing of gRPC or HTTP."""
