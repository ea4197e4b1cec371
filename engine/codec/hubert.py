"""HuBERT, the codec's semantic model: conv feature extractor, feature projection, weight-normed
positional convolution, post-norm transformer encoder. Inference only (no SpecAugment, no dropout).

Parameter names are those of the official file (`semantic_model.encoder.layers.0.attention.q_proj.weight`,
`semantic_model.encoder.pos_conv_embed.conv.parametrizations.weight.original0`, ...).
Right-padded batches give each clip its solo result up to summation order: the first GroupNorm takes each
clip's statistics over its own frames, padded frames are zeroed before the positional convolution and
attention never reads them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from engine.codec.config import SemanticConfig
from engine.codec.lengths import conv_output_lengths, padded_limits
from engine.devices import building_on_meta, to_device

# transformers' HuBERT initialisation: Linear weights drawn with this std, every conv weight He-normal.
INITIALIZER_RANGE = 0.02


class FeatureConvLayer(nn.Module):
    """A valid (unpadded) strided conv, an optional norm, GELU."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, bias: bool, norm: str | None):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size=kernel, stride=stride, bias=bias)
        if norm == "group":  # one group per channel: each channel normalised over time
            self.layer_norm = nn.GroupNorm(c_out, c_out, affine=True)
        elif norm == "layer":  # each frame normalised over channels
            self.layer_norm = nn.LayerNorm(c_out, elementwise_affine=True)
        else:
            self.layer_norm = None

    def forward(self, x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
        x, lengths = self.conv(x), conv_output_lengths(self.conv, lengths)
        if isinstance(self.layer_norm, nn.GroupNorm):
            x = self._group_norm(x, lengths)
        elif self.layer_norm is not None:
            x = self.layer_norm(x.transpose(-2, -1)).transpose(-2, -1)
        return F.gelu(x), lengths

    def _group_norm(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Each clip's channels normalised over its own frames, for the whole batch at once: a handful of
        kernels for any batch, where a norm per clip took ~3 a clip. Two passes, the mean and then the
        centred squares (tests/test_codec.py: within 0.012 of float64 on an offset channel, where the
        per-clip norm is off by 0.016).
        Frames past a clip's length come out as the norm's bias: the valid convolutions after this never read
        them into a valid frame."""
        limits = padded_limits(x, lengths)
        if limits is None:
            return self.layer_norm(x)
        valid = (torch.arange(x.shape[-1], device=x.device) < limits[:, None]).to(x.dtype)[:, None, :]
        count = limits.to(x.dtype)[:, None, None]
        mean = (x * valid).sum(-1, keepdim=True) / count
        centred = (x - mean).mul_(valid)
        variance = torch.linalg.vector_norm(centred, dim=-1, keepdim=True).square_() / count
        norm = self.layer_norm
        scale = torch.rsqrt(variance + norm.eps) * norm.weight[:, None]
        return centred.mul_(scale).add_(norm.bias[:, None])


class FeatureEncoder(nn.Module):
    def __init__(self, cfg: SemanticConfig):
        super().__init__()
        layers, c_in = [], 1
        for i, (c_out, kernel, stride) in enumerate(zip(cfg.conv_dim, cfg.conv_kernel, cfg.conv_stride)):
            norm = "layer" if cfg.feat_extract_norm == "layer" else ("group" if i == 0 else None)
            layers.append(FeatureConvLayer(c_in, c_out, kernel, stride, cfg.conv_bias, norm))
            c_in = c_out
        self.conv_layers = nn.ModuleList(layers)

    def forward(self, wav: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[int]]:
        """wav [B, T] -> features [B, conv_dim[-1], F] and frames per clip."""
        x = wav[:, None]
        for layer in self.conv_layers:
            x, lengths = layer(x, lengths)
        return x, lengths


class FeatureProjection(nn.Module):
    def __init__(self, cfg: SemanticConfig):
        super().__init__()
        width = cfg.conv_dim[-1]
        self.layer_norm = nn.LayerNorm(width, eps=cfg.layer_norm_eps) if cfg.feat_proj_layer_norm else None
        self.projection = nn.Linear(width, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return self.projection(x)


class PositionalConvEmbedding(nn.Module):
    """A grouped conv over time with a weight norm over the kernel axis (dim 2), GELU."""

    def __init__(self, cfg: SemanticConfig):
        super().__init__()
        kernel = cfg.num_conv_pos_embeddings
        # weight_norm takes the weight's norm as it registers, which on meta imports torch._dynamo
        # (building_on_meta): there this small conv is built on the CPU; the file's weights replace it.
        conv = nn.Conv1d(
            cfg.hidden_size,
            cfg.hidden_size,
            kernel_size=kernel,
            padding=kernel // 2,
            groups=cfg.num_conv_pos_embedding_groups,
            device="cpu" if building_on_meta() else None,
        )
        self.conv = weight_norm(conv, name="weight", dim=2)
        self.trim = 1 - kernel % 2  # an even kernel with padding kernel // 2 yields one frame too many

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, F, hidden] -> [B, F, hidden]."""
        y = self.conv(x.transpose(1, 2))
        if self.trim:
            y = y[:, :, : -self.trim]
        return F.gelu(y).transpose(1, 2)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.q_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, F, hidden]; mask [B, 1, F, F] bool (True: attend) or None."""
        batch, frames, _ = x.shape
        q, k, v = (
            proj(x).view(batch, frames, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(batch, frames, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: SemanticConfig):
        super().__init__()
        self.intermediate_dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output_dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_dense(F.gelu(self.intermediate_dense(x)))


class EncoderLayer(nn.Module):
    """Post-norm: attention, add, norm; feed-forward, add, norm."""

    def __init__(self, cfg: SemanticConfig):
        super().__init__()
        self.attention = SelfAttention(cfg.hidden_size, cfg.num_attention_heads)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.layer_norm(x + self.attention(x, mask))
        return self.final_layer_norm(x + self.feed_forward(x))


class Encoder(nn.Module):
    def __init__(self, cfg: SemanticConfig):
        super().__init__()
        self.pos_conv_embed = PositionalConvEmbedding(cfg)
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
        """The input of the first layer and every layer's output, each [B, F, hidden]."""
        x = self.layer_norm(x + self.pos_conv_embed(x))
        states = [x]
        for layer in self.layers:
            x = layer(x, mask)
            states.append(x)
        return states


class Hubert(nn.Module):
    def __init__(self, cfg: SemanticConfig):
        super().__init__()
        self.feature_extractor = FeatureEncoder(cfg)
        self.feature_projection = FeatureProjection(cfg)
        self.encoder = Encoder(cfg)
        if not self.encoder.layer_norm.weight.is_meta:  # on meta the weights come from a file next
            init_as_transformers(self)

    def forward(self, wav: torch.Tensor, lengths: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        """wav [B, T] right-padded, lengths in samples -> hidden states (the first layer's input and
        every layer's output, each [B, F, hidden]) and each clip's frames."""
        features, frames = self.feature_extractor(wav, lengths)
        x = self.feature_projection(features.transpose(1, 2))
        mask = None
        if any(f < x.shape[1] for f in frames):
            limits = to_device(torch.tensor(frames), x.device)  # the host does not wait for the stream
            valid = torch.arange(x.shape[1], device=x.device) < limits[:, None]
            x = x.masked_fill(~valid[:, :, None], 0)
            mask = valid[:, None, None, :].expand(-1, 1, x.shape[1], -1)
        return self.encoder(x, mask), frames


@torch.no_grad()
def init_as_transformers(hubert: Hubert) -> None:
    """Initialise as transformers initialises a new HubertModel, with the same random draws in the same
    order, so that a codec built under a fixed seed (the tiny checkpoint, the benchmarks' random codecs)
    keeps the weights it had when transformers built its HuBERT. The modules are registered in
    transformers' order, which makes modules() walk them in its order."""
    for module in hubert.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=INITIALIZER_RANGE)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Conv1d):
            # transformers draws twice into every conv weight (normal, then He-normal over it). A
            # weight-normed weight is recomputed from its parametrization on each read, so there both
            # draws land in a temporary and the parametrization keeps the default init.
            if parametrize.is_parametrized(module, "weight"):
                weight = torch.empty_like(module.weight)
            else:
                weight = module.weight
            nn.init.normal_(weight, std=INITIALIZER_RANGE)
            nn.init.kaiming_normal_(weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
