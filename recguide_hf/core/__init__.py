"""The decoding core: the engine's round, its maths and its policy. Tensors in, tensors out; no transformers."""
