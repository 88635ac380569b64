"""The loaded-model interface and its backends (native, TransformerLens bridge), model sources, loading, the GGUF weights cache and device maps."""
