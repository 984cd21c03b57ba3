"""Where users meet the engine: HF `generate` / `custom_generate`, assisted generation, lm-eval."""
