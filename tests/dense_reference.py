"""A plain dense OmniVoice forward pass, one sequence at a time: the reference the packed model is tested
against where the official package is absent. Written from the architecture description, sharing no code
with engine.model: explicit [L, L] bidirectional mask, matmul-softmax attention, float64 optional.
"""

from __future__ import annotations

import math

import torch


def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rotate(x, positions, theta):
    """Rotary embedding on x [heads, L, D]: pairs (i, i + D/2) rotate by position * theta^(-2i/D)."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = positions.to(torch.float64)[:, None] * freq[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def dense_logits(sd: dict, cfg, input_ids: torch.Tensor, audio_mask: torch.Tensor, dtype=torch.float64):
    """Logits [L, C, V] of every position of one sequence (input_ids [C, L], audio_mask [L])."""
    sd = {k: v.to(dtype) for k, v in sd.items()}
    llm = cfg.llm
    n_cb, vocab = cfg.num_audio_codebook, cfg.audio_vocab_size
    length = input_ids.shape[1]
    eps = llm.rms_norm_eps

    hidden = torch.zeros(length, llm.hidden_size, dtype=dtype)
    for pos in range(length):
        if audio_mask[pos]:
            for cb in range(n_cb):
                hidden[pos] += sd["audio_embeddings.weight"][int(input_ids[cb, pos]) + cb * vocab]
        else:
            hidden[pos] = sd["llm.embed_tokens.weight"][int(input_ids[0, pos])]

    positions = torch.arange(length)
    allowed = torch.ones(length, length, dtype=torch.bool)  # bidirectional: everyone sees everyone
    group = llm.num_attention_heads // llm.num_key_value_heads
    for i in range(llm.num_hidden_layers):
        p = f"llm.layers.{i}."
        x = _rms(hidden, sd[p + "input_layernorm.weight"], eps)
        q = (
            (x @ sd[p + "self_attn.q_proj.weight"].T)
            .view(length, llm.num_attention_heads, -1)
            .transpose(0, 1)
        )
        k = (
            (x @ sd[p + "self_attn.k_proj.weight"].T)
            .view(length, llm.num_key_value_heads, -1)
            .transpose(0, 1)
        )
        v = (
            (x @ sd[p + "self_attn.v_proj.weight"].T)
            .view(length, llm.num_key_value_heads, -1)
            .transpose(0, 1)
        )
        q = _rotate(_rms(q, sd[p + "self_attn.q_norm.weight"], eps), positions, llm.rope_theta)
        k = _rotate(_rms(k, sd[p + "self_attn.k_norm.weight"], eps), positions, llm.rope_theta)
        heads = []
        for h in range(llm.num_attention_heads):
            scores = q[h] @ k[h // group].T / math.sqrt(llm.head_dim)
            scores = scores.masked_fill(~allowed, float("-inf"))
            heads.append(torch.softmax(scores, dim=-1) @ v[h // group])
        attn = torch.cat(heads, dim=-1)
        hidden = hidden + attn @ sd[p + "self_attn.o_proj.weight"].T
        x = _rms(hidden, sd[p + "post_attention_layernorm.weight"], eps)
        gate = x @ sd[p + "mlp.gate_proj.weight"].T
        up = x @ sd[p + "mlp.up_proj.weight"].T
        hidden = hidden + (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    out = _rms(hidden, sd["llm.norm.weight"], eps) @ sd["audio_heads.weight"].T
    return out.view(length, n_cb, vocab)


def upstream_style_step(tokens, cond, uncond, k, gen, mask_id, noise=None, step=0):
    """One decoding step for one request in upstream's layout (tokens [C, T], logits [C, T, V]).

    noise: an engine.generate.decoding.RequestNoise of this request when a temperature is nonzero.
    """
    c, u = torch.log_softmax(cond, -1), torch.log_softmax(uncond, -1)
    lp = torch.log_softmax(c + gen.guidance_scale * (c - u), -1)
    lp[..., mask_id] = -float("inf")
    if gen.class_temperature > 0:
        val, ind = lp.topk(math.ceil(0.1 * lp.shape[-1]), dim=-1)
        filtered = torch.full_like(lp, -float("inf")).scatter(-1, ind, val)
        uniforms = noise.class_uniforms(ind.shape[-1]).transpose(0, 1)  # drawn as [T, C, top]
        g = torch.zeros_like(lp).scatter(-1, ind, -torch.log(-torch.log(uniforms + 1e-10) + 1e-10))
        pred = (filtered / gen.class_temperature + g).argmax(-1)
    else:
        pred = lp.argmax(-1)
    scores = lp.max(-1)[0] - torch.arange(lp.shape[0]).view(-1, 1) * gen.layer_penalty_factor
    if gen.position_temperature > 0:
        uniforms = noise.position[step].T
        scores = scores / gen.position_temperature - torch.log(-torch.log(uniforms + 1e-10) + 1e-10)
    scores.masked_fill_(tokens != mask_id, -float("inf"))
    _, idx = torch.topk(scores.flatten(), k)
    flat = tokens.flatten().clone()
    flat[idx] = pred.flatten()[idx]
    return flat.view_as(tokens)


def dense_generate(sd, cfg, prompt_ids, ref_tokens, target_len, gen, schedule):
    """Greedy generation of one request with the dense forward pass: tokens [C, target_len]."""
    n_cb, mask_id = cfg.num_audio_codebook, cfg.audio_mask_id
    text = torch.tensor(prompt_ids).repeat(n_cb, 1)
    ref = ref_tokens if ref_tokens is not None else torch.zeros(n_cb, 0, dtype=torch.long)
    tokens = torch.full((n_cb, target_len), mask_id)
    n_text = text.shape[1]
    for k in schedule:
        cond_ids = torch.cat([text, ref, tokens], dim=1)
        cond_mask = torch.arange(cond_ids.shape[1]) >= n_text
        cond = dense_logits(sd, cfg, cond_ids, cond_mask)[-target_len:].float().transpose(0, 1)
        uncond = (
            dense_logits(sd, cfg, tokens, torch.ones(target_len, dtype=torch.bool)).float().transpose(0, 1)
        )
        tokens = upstream_style_step(tokens, cond, uncond, k, gen, mask_id)
    return tokens
