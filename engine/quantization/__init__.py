"""Weight-only quantization (--quantization, GGUF blocks): layers (the packed linear layers and
their packing), plan (the plan that swaps a loaded model's layers for them) and gguf_blocks (a
.gguf file's blocks served as they are). Imports torch."""
