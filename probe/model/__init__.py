"""headprobe's own transformer, its model families, the Hugging Face conversion, head removal and checkpoints."""
