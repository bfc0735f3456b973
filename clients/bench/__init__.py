"""``llmrpc bench``: the load tool (``serve``) and the in-process engine benchmark
(``throughput``). Every performance figure this project quotes comes from here."""
