"""Graph rewrites around quantization (float islands, fake-quant debugging)."""
