"""Model sources: finding, checking and converting a model folder or GGUF file, and its generation
config. model_source imports no torch or Transformers."""
