"""Execution: a scheduled step as tensors through the model (model runner), CUDA graphs,
torch.compile, the Triton kernels' start-up warm-up, the device and its host staging, CPU threads.
Imports torch."""
