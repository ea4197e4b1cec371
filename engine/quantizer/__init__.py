"""The offline W4A4 quantizer (never imported at run time): calibration, GPTQ, low-rank, smoothing."""
