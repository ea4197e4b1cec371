"""W4A4 quantization: format, reference numerics, GPTQ, low-rank correction, calibration, W4A4Linear."""
