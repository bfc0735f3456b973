"""LoRA adapters: their plain types (no torch), PEFT folders read and checked, the engine's registry
and slots, and the adapted layers (torch)."""
