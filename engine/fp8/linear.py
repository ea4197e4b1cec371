"""Fp8Linear: the model's Linear interface in FP8 (engine/fp8/reference.py), made at load from a dense Linear.

On CUDA the GEMM is cuBLASLt's row-wise scaled FP8 GEMM (torch._scaled_mm, fp32 accumulation, bf16/fp16
out, the bias in its epilogue), and the activations are quantized by the kernel that produces them
(csrc/fp8_quantize.cu): RMSNorm -> codes for q/k/v and gate/up, silu(gate) * up -> codes for down_proj,
and a copy pass for o_proj (the attention kernel is a library's). Elsewhere, or with the fused kernels off,
the same numerics run in torch. The block's residual add runs in the next norm's kernel (RMSNorm -> codes
after x + delta).

A merged (gate, up) Fp8Linear hands down_proj its output already quantized (Fp8Activation): every backbone
Linear of an fp8 model is an Fp8Linear (engine/loading.py), so down_proj accepts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.fp8.reference import E4M3, KERNEL_MAX_K, fp8_matmul_reference, quantize_rows
from engine.kernels.fused import fused_ops
from engine.model.layers import fits_row_kernels, silu_mul
from engine.model.linear import DenseLinear, Linear, QuantizedLinear


@dataclass
class Fp8Activation:
    """A Linear input quantized row-wise by the kernel that produced it: codes [M, K], scales [M, 1], and
    the leading shape and dtype of the values it stands for."""

    q: Tensor
    scale: Tensor
    lead: tuple[int, ...]
    dtype: torch.dtype


def _rows(x: Tensor) -> Tensor:
    """x as [M, K] rows the quantize kernels can read (contiguous, 16-byte aligned)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() and x2.data_ptr() % 16 == 0 else x2.contiguous()


class Fp8Linear(QuantizedLinear):
    """y = FP8 linear of x per engine/fp8/reference.py; e4m3 weights [N, K] with float32 scales [N]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.splits = (out_features,)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=E4M3))
        self.register_buffer("wscale", torch.ones(out_features))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_dense(cls, linear: DenseLinear) -> Fp8Linear:
        """The FP8 form of a dense Linear (its weights quantized per output channel, on its device)."""
        w = linear.weight.detach()
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        q, scale = quantize_rows(w)
        layer.qweight, layer.wscale = q, scale.reshape(-1).contiguous()
        layer.bias = None if linear.bias is None else linear.bias.detach().float()
        layer.splits, layer.fused = linear.splits, linear.fused
        return layer

    def _kernels(self, x: Tensor):
        fits = x.shape[-1] % 8 == 0 and x.shape[-1] <= KERNEL_MAX_K
        return fused_ops(x) if self.fused and fits else None

    def quantize(self, x: Tensor) -> Fp8Activation:
        """x [..., K] quantized row-wise (the copy kernel on CUDA)."""
        ops = self._kernels(x)
        q, scale = (
            ops.fp8_quantize(_rows(x)) if ops is not None else quantize_rows(x.reshape(-1, x.shape[-1]))
        )
        return Fp8Activation(q, scale, tuple(x.shape[:-1]), x.dtype)

    def forward(self, x: Tensor | Fp8Activation, residual: Tensor | None = None) -> Tensor:
        a = x if isinstance(x, Fp8Activation) else self.quantize(x)
        if a.q.is_cuda:
            bias = None if self.bias is None else self.bias.to(a.dtype)
            y = torch._scaled_mm(
                a.q,
                self.qweight.t(),
                scale_a=a.scale,
                scale_b=self.wscale.view(1, -1),
                bias=bias,
                out_dtype=a.dtype,
            )
        else:
            y = fp8_matmul_reference(a.q, a.scale, self.qweight, self.wscale, self.bias, a.dtype)
        y = y.view(*a.lead, self.out_features)
        return y if residual is None else residual + y

    def forward_normed(self, x: Tensor, norm, delta: Tensor | None = None) -> Tensor:
        ops = self._kernels(x)
        if ops is None or norm.weight.dtype != x.dtype or not all(map(fits_row_kernels, (x, delta))):
            return self(norm(x, delta))
        rows = x.view(-1, x.shape[-1])
        if delta is None:
            q, scale = ops.rms_norm_fp8(rows, norm.weight, norm.eps)
        else:
            q, scale = ops.add_rms_norm_fp8(rows, delta.view(rows.shape), norm.weight, norm.eps)
        return self(Fp8Activation(q, scale, tuple(x.shape[:-1]), x.dtype))

    def forward_swiglu(self, x: Tensor, norm, delta: Tensor | None = None) -> Fp8Activation:
        """silu(gate) * up of norm(x) (x + delta as forward_normed), quantized for down_proj (by the silu_mul
        kernel on CUDA)."""
        gate, up = self.forward_normed(x, norm, delta).split(self.splits, dim=-1)
        ops = self._kernels(gate)
        lead = tuple(gate.shape[:-1])
        if ops is not None:
            q, scale = ops.silu_mul_fp8(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]))
        else:
            q, scale = quantize_rows(silu_mul(gate, up, False).reshape(-1, gate.shape[-1]))
        return Fp8Activation(q, scale, lead, gate.dtype)

    @classmethod
    def merge(cls, linears: list[Linear]) -> Fp8Linear | None:
        """Per-output-channel scales make merging exact: codes, scales and biases side by side."""
        if not all(type(linear) is cls for linear in linears):
            return None
        if len({(linear.in_features, linear.qweight.device) for linear in linears}) != 1:
            return None
        with torch.device("meta"):
            merged = cls(linears[0].in_features, sum(linear.out_features for linear in linears))
        merged.qweight = torch.cat([linear.qweight for linear in linears])
        merged.wscale = torch.cat([linear.wscale for linear in linears])
        if any(linear.bias is not None for linear in linears):
            merged.bias = torch.cat(
                [
                    linear.bias if linear.bias is not None else linear.wscale.new_zeros(linear.out_features)
                    for linear in linears
                ]
            )
        merged.splits = tuple(s for linear in linears for s in linear.splits)
        merged.fused = all(linear.fused for linear in linears)
        return merged

    def extra_repr(self) -> str:
        merged = f", splits={self.splits}" if len(self.splits) > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3{merged}"
