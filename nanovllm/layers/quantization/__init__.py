"""Weight quantization methods chosen at load time (EngineConfig.quantization); each is a per-layer object."""
