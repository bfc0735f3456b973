"""Structured output: grammars (xgrammar, llguidance), their compile lanes off the step, and the
step's token masks. The masks import torch; compiling does not."""
