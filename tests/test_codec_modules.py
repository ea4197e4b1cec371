"""Our codec's parts against transformers' (the reference; a test dependency only), at toy width on CPU in
float32, with fresh random weights in every parameter and random inputs: the DAC encoder and decoder, the
Snake activation, HuBERT (and the variants its config can select), the config's derived values, and the
random init that the tiny checkpoint is drawn from.

The modules compute the same operations in the same order, so outputs are asserted bit-for-bit equal
(torch.equal), not within a tolerance. The one exception is HuBERT on a padded batch with the GroupNorm
feature extractor: ours normalises each clip over its own frames, the reference over the padding too, so
there each clip is compared with the reference run on that clip alone, within 1e-5 absolute (summation
order; features of magnitude ~1).
"""

import json

import pytest
import torch
from torch import nn
from transformers import AutoModel, DacConfig, HiggsAudioV2TokenizerConfig, HubertConfig, HubertModel
from transformers.models.dac.modeling_dac import DacDecoder, DacEncoder, Snake1d

from engine.codec import Codec
from engine.codec.acoustic import AcousticDecoder, AcousticEncoder, Snake
from engine.codec.checkpoint import OMNIVOICE_CODEC_CONFIG
from engine.codec.config import AcousticConfig, CodecConfig, SemanticConfig
from engine.codec.hubert import Hubert
from engine.codec.quantizer import ResidualVectorQuantizer
from engine.codec.semantic import SemanticEncoder
from engine.tiny.codec import TINY_CODEC_CONFIG


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Perturb every parameter (biases and norm scales included) around its init, so that no parameter is
    left at a value (0, 1) that would hide it being read wrongly; activations stay moderate."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            spread = 0.5 * p.std().item() if p.numel() > 1 and p.std() > 0 else 0.1
            p.add_(torch.randn(p.shape, generator=g) * spread)
    return module.eval()


def acoustic_configs(raw: dict) -> tuple[DacConfig, AcousticConfig]:
    """The reference's DAC config as HiggsAudioV2 builds it, and ours, from one codec config."""
    theirs = HiggsAudioV2TokenizerConfig.from_dict(json.loads(json.dumps(raw))).acoustic_model_config
    return theirs, CodecConfig.from_dict(raw).acoustic_model_config


def semantic_configs(**changes) -> tuple[HubertConfig, SemanticConfig]:
    raw = {**TINY_CODEC_CONFIG["semantic_model_config"], **changes}
    theirs = HubertConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    return theirs, CodecConfig.from_dict(
        {**TINY_CODEC_CONFIG, "semantic_model_config": raw}
    ).semantic_model_config


def copied(ours: nn.Module, reference: nn.Module) -> nn.Module:
    ours.load_state_dict(reference.state_dict(), strict=True)
    return ours.eval()


# ------------------------------------------------------------------------------------------- DAC


def test_snake_is_the_reference_snake():
    reference = randomize(Snake1d(6), 1)
    ours = copied(Snake(6), reference)
    x = torch.randn(3, 6, 50) * 3
    assert torch.equal(ours(x), reference(x))


@pytest.mark.parametrize("raw", [TINY_CODEC_CONFIG, OMNIVOICE_CODEC_CONFIG], ids=["tiny", "real-width"])
def test_acoustic_encoder_is_the_reference_encoder(raw):
    if raw is OMNIVOICE_CODEC_CONFIG:  # the real layout at a width CPU runs in a second
        raw = {**raw, "acoustic_model_config": {**raw["acoustic_model_config"], "encoder_hidden_size": 4}}
    theirs, cfg = acoustic_configs(raw)
    reference = randomize(DacEncoder(theirs), 2)
    ours = copied(AcousticEncoder(cfg), reference)
    wav = torch.randn(2, 1, 960 * 7) * 0.3
    with torch.no_grad():
        want = reference(wav)
        got, frames = ours(wav, [wav.shape[-1]] * 2)
    assert frames == [want.shape[-1]] * 2
    assert torch.equal(got, want)


def test_acoustic_decoder_is_the_reference_decoder():
    theirs, cfg = acoustic_configs(TINY_CODEC_CONFIG)
    reference = randomize(DacDecoder(theirs), 3)
    # As HiggsAudioV2 adapts DAC's decoder: odd strides get output_padding 1, no final tanh
    for module in reference.modules():
        if isinstance(module, nn.ConvTranspose1d):
            module.output_padding = (module.stride[0] % 2,)
    reference.tanh = nn.Identity()
    ours = copied(AcousticDecoder(cfg), reference)
    latents = torch.randn(2, cfg.hidden_size, 9)
    with torch.no_grad():
        want = reference(latents)
        got, samples = ours(latents, [9, 9])
    assert want.shape == (2, 1, 9 * 960) and samples == [9 * 960] * 2
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------- HuBERT


def hubert_pair(seed: int, **changes) -> tuple[HubertModel, Hubert]:
    theirs, cfg = semantic_configs(**changes)
    reference = randomize(HubertModel(theirs), seed)
    return reference, copied(Hubert(cfg), reference)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"feat_extract_norm": "layer"},
        {"conv_bias": True, "feat_proj_layer_norm": False},
        {"num_conv_pos_embeddings": 15, "num_attention_heads": 4},
    ],
    ids=["base", "layer-norm-extractor", "conv-bias-no-projection-norm", "odd-pos-kernel"],
)
def test_hubert_hidden_states_are_the_reference_ones(changes):
    reference, ours = hubert_pair(4, **changes)
    wav = torch.randn(2, 16000) * 0.3
    with torch.no_grad():
        want = reference(wav, output_hidden_states=True).hidden_states
        got, frames = ours(wav, [16000, 16000])
    assert frames == [want[0].shape[1]] * 2
    assert len(got) == len(want) == 3  # the first layer's input, then each layer's output
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_hubert_padded_batch_is_the_reference_with_its_attention_mask():
    """With the per-frame LayerNorm extractor nothing is normalised over time, so our padded batch and
    the reference's (with its attention mask) compute the same thing: zeroed padded frames, masked keys."""
    reference, ours = hubert_pair(5, feat_extract_norm="layer")
    lengths = [16000, 9000, 12345]
    wav = torch.randn(3, 16000) * 0.3
    for i, n in enumerate(lengths):
        wav[i, n:] = 0
    mask = (torch.arange(16000) < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        want = reference(wav, attention_mask=mask, output_hidden_states=True).hidden_states
        got, frames = ours(wav, lengths)
    assert frames == reference._get_feat_extract_output_lengths(torch.tensor(lengths)).tolist()
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_hubert_padded_batch_gives_each_clip_the_reference_solo_result():
    reference, ours = hubert_pair(6)
    lengths = [16000, 7001, 12000]
    wav = torch.randn(3, 16000) * 0.3
    for i, n in enumerate(lengths):
        wav[i, n:] = 0
    with torch.no_grad():
        got, frames = ours(wav, lengths)
        for i, (n, f) in enumerate(zip(lengths, frames)):
            alone = reference(wav[i : i + 1, :n], output_hidden_states=True).hidden_states
            for g, w in zip(got, alone):
                assert w.shape[1] == f
                assert (g[i, :f] - w[0]).abs().max().item() <= 1e-5


def test_hubert_state_dict_is_the_reference_layout():
    theirs, cfg = semantic_configs()
    with torch.device("meta"):
        ours, reference = Hubert(cfg).state_dict(), HubertModel(theirs).state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in reference.items()}
    assert "encoder.pos_conv_embed.conv.parametrizations.weight.original1" in ours


# ----------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("raw", [TINY_CODEC_CONFIG, OMNIVOICE_CODEC_CONFIG], ids=["tiny", "real"])
def test_config_derives_what_the_reference_config_derives(raw):
    theirs = HiggsAudioV2TokenizerConfig.from_dict(json.loads(json.dumps(raw)))
    ours = CodecConfig.from_dict(raw)
    for name in (
        "sample_rate", "semantic_sample_rate", "hop_length", "frame_rate", "hidden_size",
        "semantic_hidden_size", "num_quantizers", "semantic_downsample_factor", "codebook_size",
        "codebook_dim", "kernel_size", "unit_kernel_size",
    ):  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), name
    for name in ("strides", "channel_ratios", "block_dilations", "target_bandwidths"):
        assert list(getattr(ours, name)) == list(getattr(theirs, name)), name
    for name in ("encoder_hidden_size", "decoder_hidden_size", "hidden_size"):
        assert getattr(ours.acoustic_model_config, name) == getattr(theirs.acoustic_model_config, name)
    for name in ("downsampling_ratios", "upsampling_ratios"):
        assert list(getattr(ours.acoustic_model_config, name)) == list(
            getattr(theirs.acoustic_model_config, name)
        )
    for name in SemanticConfig.__dataclass_fields__:
        want = getattr(theirs.semantic_model_config, name)
        assert getattr(ours.semantic_model_config, name) == (tuple(want) if isinstance(want, list) else want)


# ------------------------------------------------------------------------------------------- init


def test_codec_init_draws_what_the_reference_modules_drew():
    """Codec(cfg) under a seed gets exactly the weights the transformers-built codec got (DAC modules
    with torch's default init, HuBERT with transformers' re-initialisation) and leaves the generator in
    the same state: the tiny checkpoint, drawn this way, keeps its bytes."""
    raw = TINY_CODEC_CONFIG
    cfg = CodecConfig.from_dict(raw)
    theirs = HiggsAudioV2TokenizerConfig.from_dict(json.loads(json.dumps(raw)))
    torch.manual_seed(7)
    reference = {
        "acoustic_encoder": DacEncoder(theirs.acoustic_model_config),
        "acoustic_decoder": DacDecoder(theirs.acoustic_model_config),
        "encoder_semantic": SemanticEncoder(cfg),
        "semantic_model": AutoModel.from_config(theirs.semantic_model_config),
        "fc": nn.Linear(cfg.hidden_size, cfg.hidden_size),
        "fc2": nn.Linear(cfg.hidden_size, cfg.acoustic_model_config.hidden_size),
        "quantizer": ResidualVectorQuantizer(cfg),
    }
    generator_after = torch.get_rng_state()
    torch.manual_seed(7)
    ours = Codec(cfg).state_dict()
    assert torch.equal(torch.get_rng_state(), generator_after)
    want = {f"{prefix}.{k}": v for prefix, m in reference.items() for k, v in m.state_dict().items()}
    assert set(ours) == set(want)
    for name, tensor in ours.items():
        assert torch.equal(tensor, want[name]), name


def test_a_codec_built_on_the_meta_device_skips_the_hubert_init(monkeypatch):
    """Codec.from_dir builds on meta and assigns the file's weights: transformers' re-initialisation of
    HuBERT would only spend time there."""
    import engine.codec.hubert

    def no_init(hubert):
        raise AssertionError("HuBERT drew its random init")

    monkeypatch.setattr(engine.codec.hubert, "init_as_transformers", no_init)
    cfg = CodecConfig.from_dict(TINY_CODEC_CONFIG)
    with torch.device("meta"):
        assert Codec(cfg).semantic_model.encoder.layer_norm.weight.is_meta
    with pytest.raises(AssertionError, match="random init"):
        Codec(cfg)
