"""The forward layer: the engine's `Backbone` over transformers models, the row cache, the bundled model class."""
