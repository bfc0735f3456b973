"""The continuous-batching engine: knows nothing of gRPC or HTTP. A request's path through it is
the names of its subpackages: ``client`` -> ``core`` -> ``sched`` -> ``runner`` -> ``sample`` ->
``output``; ``structured_output``, ``lora``, ``pooling`` and ``quantization`` hook into that path,
``loading`` and ``models`` build what it runs, ``parallel`` shards it. The modules here are the
plain types every side shares (configuration, requests, messages, load figures)."""
