"""Attention layouts and what they cost (parameters, FLOPs, KV cache, attention-matrix bytes), and a loaded model's spec."""
