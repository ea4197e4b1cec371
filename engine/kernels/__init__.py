"""Python face of csrc/: build/load the CUDA extension, the W4A4 ops, capability checks and the fallback."""

from engine.kernels.w4a4 import (
    CudaW4A4Backend,
    ReferenceW4A4Backend,
    choose_w4a4_backend,
    w4a4_backend_report,
)

__all__ = ["CudaW4A4Backend", "ReferenceW4A4Backend", "choose_w4a4_backend", "w4a4_backend_report"]
