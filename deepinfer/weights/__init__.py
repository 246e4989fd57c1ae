"""Checkpoint reading: tensor names (`names`), FP8/FP4 dequantization (`quant`), the loader (`loader`)."""
