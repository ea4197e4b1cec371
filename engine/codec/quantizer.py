"""Residual vector quantizer with Euclidean codebooks (names: quantizer.quantizers.{i}.*)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.codec.config import CodecConfig


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("embed", torch.zeros(size, dim))

    def nearest(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, dim] -> index [N] of the closest codeword. The distance is written term by term as
        the reference writes it, so near-ties round the same way and the codes agree."""
        embed = self.embed.t()
        dist = -(h.pow(2).sum(1, keepdim=True) - 2 * h @ embed + embed.pow(2).sum(0, keepdim=True))
        return dist.max(dim=-1).indices


class VectorQuantizer(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.project_in = nn.Linear(cfg.hidden_size, cfg.codebook_dim)
        self.project_out = nn.Linear(cfg.codebook_dim, cfg.hidden_size)
        self.codebook = Codebook(cfg.codebook_size, cfg.codebook_dim)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, hidden, F] -> codes [B, F]."""
        h = self.project_in(x.permute(0, 2, 1))
        return self.codebook.nearest(h.reshape(-1, h.shape[-1])).view(h.shape[:-1])

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, F] -> vectors [B, hidden, F]."""
        return self.project_out(F.embedding(codes, self.codebook.embed)).permute(0, 2, 1)


class ResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.quantizers = nn.ModuleList(VectorQuantizer(cfg) for _ in range(cfg.num_quantizers))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, hidden, F] -> codes [B, C, F]; each stage quantizes what the previous ones left."""
        residual, codes = x, []
        for quantizer in self.quantizers:
            index = quantizer.encode(residual)
            residual = residual - quantizer.decode(index)
            codes.append(index)
        return torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, C, F] -> summed vectors [B, hidden, F]."""
        out = torch.zeros((), dtype=self.quantizers[0].codebook.embed.dtype, device=codes.device)
        for i, quantizer in enumerate(self.quantizers):
            out = out + quantizer.decode(codes[:, i])
        return out
