"""OmniVoice inference engine: checkpoints, frontend, model, decoding, codec, W4A4 quantization.

The engine knows nothing of Ray, Parquet or job directories (see docs/ARCHITECTURE.md).
"""
