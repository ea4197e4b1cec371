"""OmniVoiceModel: the official OmniVoice network over packed variable-length sequences.

Many sequences (the conditional and unconditional copy of every request of a batch) are laid end to end
in one token axis; `cu_seqlens` marks where each starts. Positions restart at 0 in every sequence and
attention stays inside it, so a sequence's activations do not depend on its neighbours. Parameter
names equal the official state-dict keys, so official weights load with `load_state_dict`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from engine.config import LLMConfig, ModelConfig
from engine.devices import building_on_meta, to_device
from engine.model.attention import choose_attention
from engine.model.layers import LinearFactory, RMSNorm, SiblingBlock, SwiGLU, qk_norm_rope, rope_cos_sin
from engine.model.linear import default_linear, merge_linears


@dataclass
class PackedBatch:
    input_ids: Tensor  # [C, T] long; text ids repeated over the C rows at text positions
    audio_mask: Tensor  # [T] bool; True at audio positions (reference + target)
    position_ids: Tensor  # [T] long; restarts at 0 in every sequence
    cu_seqlens: Tensor  # [S+1] int32 sequence boundaries
    max_seqlen: int
    target_index: Tensor  # [n_target] long; positions whose logits are wanted

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch on `device`; from the host to CUDA without waiting for the work queued there."""
        return self.apply(lambda t: to_device(t, device))

    def apply(self, fn: Callable[[Tensor], Tensor]) -> PackedBatch:
        """A batch holding fn(tensor) for each tensor field (max_seqlen kept)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return PackedBatch(**{k: fn(v) if isinstance(v, Tensor) else v for k, v in values.items()})


class SelfAttention(SiblingBlock):
    SIBLINGS, MERGED = ("q_proj", "k_proj", "v_proj"), "qkv_proj"

    def __init__(self, prefix: str, cfg: LLMConfig, linear_factory: LinearFactory) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = linear_factory(f"{prefix}.q_proj", h, self.num_heads * d)
        self.k_proj = linear_factory(f"{prefix}.k_proj", h, self.num_kv_heads * d)
        self.v_proj = linear_factory(f"{prefix}.v_proj", h, self.num_kv_heads * d)
        self.o_proj = linear_factory(f"{prefix}.o_proj", self.num_heads * d, h)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj = None  # q/k/v as one Linear, where merge_projections could merge them
        self.fused = True

    def project(self, x: Tensor, norm: RMSNorm, delta: Tensor | None = None) -> list[Tensor]:
        """q, k and v of norm(x); with delta, of norm(x + delta), x + delta written over x."""
        if self.qkv_proj is not None:
            return list(self.qkv_proj.forward_normed(x, norm, delta).split(self.qkv_proj.splits, dim=-1))
        q = self.q_proj.forward_normed(x, norm, delta)  # x + delta is in x from here on
        return [q, self.k_proj.forward_normed(x, norm), self.v_proj.forward_normed(x, norm)]

    def project_rope(self, x: Tensor, norm: RMSNorm, delta: Tensor | None, cos: Tensor, sin: Tensor):
        """q and k of norm(x) head-normed and rotated, and v (x + delta as project): by the q/k/v GEMM where
        its implementation can, else by the qk_norm_rope kernel after it."""
        if self.qkv_proj is not None:
            heads = (self.num_heads, self.num_kv_heads)
            qkv = self.qkv_proj.forward_qkv_rope(x, norm, delta, self.q_norm, self.k_norm, cos, sin, heads)
            if qkv is not None:
                return qkv.split(self.qkv_proj.splits, dim=-1)
        q, k, v = self.project(x, norm, delta)
        t, d = x.shape[0], self.head_dim
        q, k = qk_norm_rope(
            q.view(t, self.num_heads, d),
            k.view(t, self.num_kv_heads, d),
            self.q_norm,
            self.k_norm,
            cos,
            sin,
            self.fused,
        )
        return q, k, v

    def forward(
        self,
        x: Tensor,
        delta: Tensor | None,
        norm: RMSNorm,
        cos: Tensor,
        sin: Tensor,
        batch: PackedBatch,
        attend,
    ) -> tuple[Tensor, Tensor | None]:
        """The attention block with its residual: x + o_proj(attention over norm(x)), x the residual stream
        (x + delta when the previous block left its add to this norm), handed on as forward_residual does."""
        t, d = x.shape[0], self.head_dim
        q, k, v = self.project_rope(x, norm, delta, cos, sin)
        q, k, v = (
            q.view(t, self.num_heads, d),
            k.view(t, self.num_kv_heads, d),
            v.view(t, self.num_kv_heads, d),
        )
        out = attend(q, k, v, batch.cu_seqlens, batch.max_seqlen)
        return self.o_proj.forward_residual(out.reshape(t, self.num_heads * self.head_dim), x)


class DecoderLayer(nn.Module):
    def __init__(self, index: int, cfg: LLMConfig, linear_factory: LinearFactory) -> None:
        super().__init__()
        prefix = f"llm.layers.{index}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(f"{prefix}.self_attn", cfg, linear_factory)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size, linear_factory)

    def forward(
        self, x: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, batch: PackedBatch, attend
    ) -> tuple[Tensor, Tensor | None]:
        """The residual stream after the layer, as (x, delta) for x + delta (delta None: nothing pending)."""
        x, delta = self.self_attn(x, delta, self.input_layernorm, cos, sin, batch, attend)
        return self.mlp(x, delta, self.post_attention_layernorm)


def embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding; on the meta device without its random init (building_on_meta)."""
    if building_on_meta():
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    return nn.Embedding(rows, dim)


class Qwen3Backbone(nn.Module):
    """Qwen3 without its LM head (the official checkpoint's `llm.*`), bidirectional within a sequence."""

    def __init__(self, cfg: LLMConfig, linear_factory: LinearFactory) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(i, cfg, linear_factory) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, batch: PackedBatch, attend) -> Tensor:
        """Hidden states [T, H] before the final norm."""
        cos, sin = rope_cos_sin(batch.position_ids, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        delta = None  # a block's output not yet added to x: the next norm adds it in its kernel
        for layer in self.layers:
            x, delta = layer(x, delta, cos, sin, batch, attend)
        return x if delta is None else x + delta


class OmniVoiceModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, linear_factory: LinearFactory | None = None, attention: str = "auto"
    ):
        super().__init__()
        self.cfg = cfg
        self.attention = attention
        hidden, codebook_rows = cfg.llm.hidden_size, cfg.num_audio_codebook * cfg.audio_vocab_size
        self.llm = Qwen3Backbone(cfg.llm, linear_factory or default_linear)
        self.audio_embeddings = embedding(codebook_rows, hidden)
        self.audio_heads = nn.Linear(hidden, codebook_rows, bias=False)
        self._backend = None
        self._backend_key = None

    def merge_projections(self, merge: Callable[[list], nn.Module | None] = merge_linears) -> None:
        """Merge each layer's q/k/v and gate/up into one Linear each where `merge` can (at load, for
        inference: the members' names leave the state dict)."""
        for layer in self.llm.layers:
            layer.self_attn.merge_projections(merge)
            layer.mlp.merge_projections(merge)

    def attention_backend(self, device: torch.device, dtype: torch.dtype):
        """The attention backend for this device and dtype, chosen once (and logged) per combination."""
        key = (self.attention, device, dtype)
        if self._backend_key != key:
            self._backend = choose_attention(self.attention, device, dtype)
            self._backend_key = key
        return self._backend

    def embed(self, input_ids: Tensor, audio_mask: Tensor) -> Tensor:
        """[T, H]: text embedding (row 0) at text positions, C codebook embeddings summed at audio ones."""
        text = self.llm.embed_tokens(input_ids[0] * ~audio_mask)  # audio ids may exceed a small text vocab
        offsets = (
            torch.arange(self.cfg.num_audio_codebook, device=input_ids.device) * self.cfg.audio_vocab_size
        )
        audio = self.audio_embeddings(input_ids * audio_mask[None, :] + offsets[:, None]).sum(dim=0)
        return torch.where(audio_mask[:, None], audio, text)

    def forward(self, batch: PackedBatch, float32: bool = True) -> Tensor:
        """Logits [n_target, C, audio_vocab] at `batch.target_index`, in float32 or the heads' dtype."""
        logits = self.head_logits(self.hidden_states(batch), batch.target_index)
        return logits.float() if float32 else logits

    def hidden_states(self, batch: PackedBatch) -> Tensor:
        """[T, H]: every position after the last layer (before the final norm); no use of target_index."""
        x = self.embed(batch.input_ids, batch.audio_mask)
        return self.llm(x, batch, self.attention_backend(x.device, x.dtype).for_forward())

    def head_logits(self, hidden: Tensor, index: Tensor) -> Tensor:
        """Logits [len(index), C, audio_vocab] of the rows `index` of hidden_states' output, in the heads'
        dtype (what the decoding step reads)."""
        x = self.llm.norm(hidden.index_select(0, index))
        return self.audio_heads(x).view(-1, self.cfg.num_audio_codebook, self.cfg.audio_vocab_size)
