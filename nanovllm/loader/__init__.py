"""Weight loaders: GGUF files and the embedded default model."""
