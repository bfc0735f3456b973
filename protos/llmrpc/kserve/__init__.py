"""KServe v2 / the Open Inference Protocol (package ``inference``): generated stubs only."""
