"""The engine core: EngineCore (model, KV cache, scheduler, sampler; one step at a time), the step
loop and the engine process's entry. Imports torch."""
