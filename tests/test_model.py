"""The packed model equals a plain dense forward pass, one sequence at a time."""

import pytest
import torch
from dense_reference import dense_logits
from torch import nn

from engine.errors import BackendUnavailable, InputError
from engine.generate.packing import GenItem, PackLayout, pack_items
from engine.model import OmniVoiceModel
from engine.model.attention import BACKENDS, choose_attention
from engine.tiny import tiny_model_config, tiny_state_dict

C, MASK = 8, 1024


def random_model(seed: int) -> tuple[OmniVoiceModel, dict]:
    cfg = tiny_model_config(vocab_size=300)
    sd = tiny_state_dict(cfg, seed=seed)
    model = OmniVoiceModel(cfg, attention="sdpa")
    model.load_state_dict(sd)
    return model.eval(), sd


def random_items(lengths, with_ref, seed):
    g = torch.Generator().manual_seed(seed)
    items = []
    for i, (n_prompt, n_ref, n_target) in enumerate(lengths):
        ref = torch.randint(0, 1024, (C, n_ref), generator=g) if with_ref[i] else None
        prompt = torch.randint(0, 300, (n_prompt,), generator=g).tolist()
        items.append(GenItem(prompt_ids=prompt, ref_tokens=ref, target_len=n_target, seed=i))
    return items, g


def randomize_targets(batch, g):
    """Decoding fills target positions step by step: test with a mix of MASK and real tokens there."""
    t = batch.target_index
    tokens = torch.randint(0, 1025, (C, len(t)), generator=g)
    batch.input_ids[:, t] = torch.where(torch.rand(len(t), generator=g) < 0.5, MASK, tokens)


def dense_targets(sd, cfg, batch, n_seqs):
    """Dense logits of every sequence, concatenated and read at the target positions."""
    bounds = batch.cu_seqlens.tolist()
    pieces = [
        dense_logits(sd, cfg, batch.input_ids[:, a:b], batch.audio_mask[a:b])
        for a, b in zip(bounds[:n_seqs], bounds[1 : n_seqs + 1])
    ]
    return torch.cat(pieces)[batch.target_index]


CASES = {
    "single_ref": ([(12, 30, 25)], [True]),
    "single_noref": ([(9, 0, 40)], [False]),
    "batch4_ref": ([(12, 30, 25), (5, 17, 60), (20, 8, 9), (7, 40, 33)], [True] * 4),
    "batch4_mixed": ([(12, 30, 25), (5, 0, 60), (20, 8, 9), (7, 0, 33)], [True, False, True, False]),
}


@pytest.mark.parametrize("case", CASES)
def test_packed_equals_dense(case):
    lengths, with_ref = CASES[case]
    model, sd = random_model(seed=len(case))
    items, g = random_items(lengths, with_ref, seed=7)
    batch = pack_items(items, C, MASK)
    randomize_targets(batch, g)
    with torch.inference_mode():
        packed = model(batch)
    dense = dense_targets(sd, model.cfg, batch, 2 * len(items))
    assert packed.dtype == torch.float32
    assert packed.shape == (2 * sum(n for _, _, n in lengths), C, 1025)
    assert (packed.double() - dense).abs().max().item() <= 1e-4


def test_padding_to_a_layout_leaves_real_logits_unchanged():
    model, _ = random_model(seed=3)
    items, g = random_items([(12, 30, 25), (5, 0, 60)], [True, False], seed=1)
    exact = pack_items(items, C, MASK)
    randomize_targets(exact, g)
    layout = PackLayout(tokens=512, sequences=16, max_seqlen=128)
    padded = pack_items(items, C, MASK, layout)
    n_real = exact.input_ids.shape[1]
    padded.input_ids[:, :n_real] = exact.input_ids
    with torch.inference_mode():
        a, b = model(exact), model(padded)
    assert torch.equal(padded.target_index, exact.target_index) and padded.input_ids.shape[1] == 512
    # padding tokens are in no sequence (attention never touches them); the unused slots are empty
    assert padded.cu_seqlens.tolist() == exact.cu_seqlens.tolist() + [n_real] * 12
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    with torch.inference_mode():  # the backbone and the heads apart, as a graph runs them
        apart = model.head_logits(model.hidden_states(padded), padded.target_index).float()
        torch.testing.assert_close(apart, b)


def test_layout_too_small_is_refused():
    items, _ = random_items([(12, 30, 25)], [True], seed=1)
    with pytest.raises(InputError, match="does not fit"):
        pack_items(items, C, MASK, PackLayout(tokens=64, sequences=4, max_seqlen=64))


def test_linear_factory_builds_the_seven_backbone_linears():
    made = []

    def factory(name, n_in, n_out):
        made.append((name, n_in, n_out))
        return nn.Linear(n_in, n_out, bias=False)

    cfg = tiny_model_config(vocab_size=300)
    OmniVoiceModel(cfg, linear_factory=factory)
    names = {n for n, _, _ in made}
    assert len(made) == 7 * cfg.llm.num_hidden_layers
    assert ("llm.layers.1.mlp.down_proj", 192, 64) in made
    assert {f"llm.layers.0.self_attn.{p}_proj" for p in "qkvo"} <= names


FAST_BACKENDS = [name for name in BACKENDS if name != "sdpa"]


def test_attention_chooser_on_cpu(caplog):
    with caplog.at_level("INFO", logger="engine.model.attention"):
        assert choose_attention("auto", torch.device("cpu"), torch.float32).name == "sdpa"
    assert "attention backend: sdpa" in caplog.text
    assert "skipped varlen: needs a CUDA device" in caplog.text
    assert "skipped flash4: " in caplog.text
    with pytest.raises(BackendUnavailable, match="varlen.*CUDA"):
        choose_attention("varlen", torch.device("cpu"), torch.float32)
    with pytest.raises(BackendUnavailable, match="unknown"):
        choose_attention("magic", torch.device("cpu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_bf16_fast_backend_matches_fp32_sdpa(backend):
    ok, reason = BACKENDS[backend]().can_use(torch.device("cuda"), torch.bfloat16)
    if not ok:
        pytest.skip(reason)
    model, _ = random_model(seed=11)
    items, g = random_items([(12, 30, 25), (5, 0, 60), (20, 8, 9), (7, 40, 33)], [True, False, True, True], 5)
    batch = pack_items(items, C, MASK)
    randomize_targets(batch, g)
    batch = batch.to("cuda")
    model = model.to("cuda")
    with torch.inference_mode():
        ref = model(batch)
        model.attention = backend
        fast_logits = model.to(torch.bfloat16)(batch)
    cos = torch.nn.functional.cosine_similarity(ref.flatten(), fast_logits.flatten(), dim=0)
    assert cos.item() >= 0.999


@pytest.mark.gpu
@pytest.mark.parametrize("separate", [True, False], ids=["contiguous", "qkv_views"])
@pytest.mark.parametrize("backend_name", FAST_BACKENDS)
def test_fast_attention_matches_sdpa_on_odd_lengths(backend_name, separate):
    """16 query heads over 8 k/v heads (the full model's grouping), odd lengths, empty sequence slots and
    padding rows in no sequence (as a graph layout packs them), q/k/v contiguous or strided views of one
    buffer: the rows in sequences match the fp32 reference to 1e-2 (bf16 inputs); a CUDA-graph replay
    equals the eager call bit for bit."""
    backend = BACKENDS[backend_name]()
    ok, reason = backend.can_use(torch.device("cuda"), torch.bfloat16)
    if not ok:
        pytest.skip(reason)
    g = torch.Generator(device="cuda").manual_seed(3)
    lengths = [37, 300, 1, 128, 0, 0]
    real = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qkv = torch.randn(real + 45, 16 + 8 + 8, 128, generator=g, device="cuda").to(torch.bfloat16)
    if separate:
        q, k, v = (t.contiguous() for t in qkv.split([16, 8, 8], dim=1))
    else:  # views of one grouped projection's output, as the model hands them over
        q, k, v = qkv.split([16, 8, 8], dim=1)
    got = backend(q, k, v, cu, 512)
    want = BACKENDS["sdpa"]()(q.float(), k.float(), v.float(), cu, 512)
    assert got.shape == want.shape
    got, want = got[:real].float(), want[:real]
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backend(q, k, v, cu, 512)
    graph.replay()
    torch.testing.assert_close(captured[:real], backend(q, k, v, cu, 512)[:real], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("per_forward", [False, True], ids=["call", "for_forward"])
def test_flash4_keeps_the_rows_its_next_call_reads_past_the_last_sequence_finite(per_forward):
    """flash-attn-4 reads K/V rows past a sequence's end (masked, but 0 x NaN is NaN). Its output is the next
    layer's input, so the rows after the last sequence that a tile can reach must come out finite even
    where the memory held NaN: two calls in a row, the second on the first's output, stay finite. Through
    for_forward (one buffer for a forward's layers, zeroed by the first) each call also equals a call of
    its own."""
    backend = BACKENDS["flash4"]()
    ok, reason = backend.can_use(torch.device("cuda"), torch.bfloat16)
    if not ok:
        pytest.skip(reason)
    g = torch.Generator(device="cuda").manual_seed(5)
    tokens, heads = 800, 8
    cu = torch.tensor([0, 200, 350, 350], dtype=torch.int32, device="cuda")
    q, k, v = (
        torch.randn(tokens, heads, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3)
    )
    attend = backend.for_forward() if per_forward else backend
    for _ in range(2):
        # freed memory full of NaN, of the size the backend allocates next
        torch.empty((tokens + backend.REACH) * heads * 128, device="cuda", dtype=torch.bfloat16).fill_(
            float("nan")
        )
        out = attend(q, k, v, cu, 256)
        assert torch.isfinite(out[:350]).all()
        assert (out[350 : 350 + backend.REACH] == 0).all()
        if per_forward:
            torch.testing.assert_close(out[:350], backend(q, k, v, cu, 256)[:350], rtol=0, atol=0)
        q = k = v = out.clone()
