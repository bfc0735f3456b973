"""Weight-only quantization (--quantization, GGUF blocks): packed linear layers and the plan that
replaces a model's layers. Imports torch."""
