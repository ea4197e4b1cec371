"""The generation loop: packed and batched equals dense one-at-a-time; batch neighbours change nothing."""

import dataclasses

import pytest
import torch
from dense_reference import dense_generate

from engine.config import EngineConfig, GenerationConfig
from engine.errors import InputError
from engine.generate.batching import BATCH_COST_TOKENS, bucket_batches, even_batches, greedy_batches
from engine.generate.decoding import unmask_schedule
from engine.generate.loop import GenItem, GraphedForward, Runner, choose_layout
from engine.generate.packing import pack_items, packed_tokens
from engine.loading import load_model
from engine.tiny import ensure_tiny_checkpoint, tiny_state_dict

C = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("cache"))


def make_items(specs, seed=0):
    """specs: (prompt length, reference frames or 0, target frames) per request."""
    g = torch.Generator().manual_seed(seed)
    return [
        GenItem(
            prompt_ids=torch.randint(0, 1000, (n_prompt,), generator=g).tolist(),
            ref_tokens=torch.randint(0, 1024, (C, n_ref), generator=g) if n_ref else None,
            target_len=n_target,
            seed=1000 + i,
        )
        for i, (n_prompt, n_ref, n_target) in enumerate(specs)
    ]


def test_greedy_batches_keep_order_and_budget_and_run_an_oversized_item_alone():
    items = make_items([(10, 0, 20), (10, 0, 20), (10, 0, 20), (100, 0, 200), (5, 0, 5)])  # 50 50 50 500 15
    chunks = greedy_batches(items, packed_tokens, 120)
    assert [len(c) for c in chunks] == [2, 1, 1, 1]
    assert [item for chunk in chunks for item in chunk] == items
    assert [len(c) for c in greedy_batches(items, packed_tokens, 10_000, max_items=2)] == [2, 2, 1]


def test_even_batches_leave_no_small_tail_and_need_no_more_batches():
    sizes = [100] * 7  # greedy under 300: 3 + 3 + 1
    assert [len(c) for c in greedy_batches(sizes, int, 300)] == [3, 3, 1]
    assert sorted(len(c) for c in even_batches(sizes, int, 300)) == [2, 2, 3]
    g = torch.Generator().manual_seed(4)
    for _ in range(200):
        items = torch.randint(1, 50, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        budget = int(torch.randint(50, 200, (1,), generator=g))
        greedy, even = greedy_batches(items, int, budget), even_batches(items, int, budget)
        assert len(even) == len(greedy) and [i for b in even for i in b] == items
        assert all(sum(b) <= budget or len(b) == 1 for b in even)
        assert min(map(sum, even)) >= min(map(sum, greedy))


BUCKETS = (512, 1024, 2048, 4096, 8192, 16384, 24576, 32768)


def bucket_cost(batches, buckets=BUCKETS):
    """What the batches cost as they run: each at its graph bucket's size (its own size where none holds
    it: it runs eagerly), plus the batch cost."""
    return sum(
        next((b for b in buckets if b >= sum(batch)), sum(batch)) + BATCH_COST_TOKENS for batch in batches
    )


def test_bucket_batches_fill_their_buckets():
    """40,000 tokens under a 32,768 budget: even halves of 20,000 run as two 24,576 buckets (49,152);
    filling a 32,768 and an 8,192 bucket runs 40,960."""
    sizes = [500] * 80
    even, filled = even_batches(sizes, int, 32768), bucket_batches(sizes, int, 32768, BUCKETS)
    assert sorted(map(sum, even)) == [20000, 20000]
    assert sorted(map(sum, filled)) == [8000, 32000] and bucket_cost(filled) < bucket_cost(even)


def test_bucket_batches_hold_every_item_once_within_budget_and_never_cost_more_than_even():
    g = torch.Generator().manual_seed(5)
    cheaper = 0
    for _ in range(300):
        items = torch.randint(
            200, 3000, (int(torch.randint(1, 200, (1,), generator=g)),), generator=g
        ).tolist()
        budget = int(torch.randint(4096, 40000, (1,), generator=g))
        buckets = [b for b in BUCKETS if b <= max(budget, 4096)]
        filled = bucket_batches(items, int, budget, buckets)
        assert sorted(i for b in filled for i in b) == sorted(items)
        assert all(sum(b) <= budget or len(b) == 1 for b in filled)
        if max(items) <= max(b for b in buckets if b <= budget):
            even = bucket_cost(even_batches(items, int, budget), buckets)
            assert bucket_cost(filled, buckets) <= even
            cheaper += bucket_cost(filled, buckets) < even
    assert cheaper >= 80, cheaper  # filled batches are taken in about a third of these cases


def test_bucket_batches_keep_even_batches_where_an_item_fits_no_bucket():
    sizes = [5000, 3000, 3000]
    assert bucket_batches(sizes, int, 6000, (1024, 4096)) == even_batches(sizes, int, 6000)


def test_packed_tokens_counts_cond_and_uncond():
    item = make_items([(10, 20, 30)])[0]
    assert Runner.packed_tokens(item) == 10 + 20 + 30 + 30


def test_generate_returns_one_token_grid_per_item(tiny):
    _, model = load_model(tiny)
    items = make_items([(10, 20, 30), (6, 0, 11)])
    out = Runner(model, EngineConfig(), "cpu", torch.float32).generate(items, GenerationConfig(num_step=8))
    assert [t.shape for t in out] == [(C, 30), (C, 11)]
    assert all(t.dtype == torch.long and t.min() >= 0 and t.max() < 1024 for t in out)


@pytest.mark.parametrize("specs", [[(9, 14, 12)], [(9, 14, 12), (5, 0, 7), (12, 6, 16), (4, 0, 5)]])
def test_greedy_generation_equals_dense_reference(tiny, specs):
    cfg, model = load_model(tiny, attention="sdpa")
    sd = tiny_state_dict(cfg)
    gen = GenerationConfig(num_step=6, position_temperature=0.0, class_temperature=0.0)
    items = make_items(specs)
    out = Runner(model, EngineConfig(), "cpu", torch.float32).generate(items, gen)
    same = total = 0
    for item, tokens in zip(items, out):
        schedule = unmask_schedule(item.target_len * C, gen.num_step, gen.t_shift)
        want = dense_generate(sd, cfg, item.prompt_ids, item.ref_tokens, item.target_len, gen, schedule)
        same += (tokens == want).sum().item()
        total += want.numel()
    assert same / total >= 0.999


def test_request_alone_equals_request_in_a_batch_of_eight(tiny):
    _, model = load_model(tiny)
    runner = Runner(model, EngineConfig(), "cpu", torch.float32)
    gen = GenerationConfig(num_step=8, position_temperature=5.0, class_temperature=1.0)
    items = make_items(
        [(9, 14, 12), (5, 0, 7), (12, 6, 16), (4, 0, 5), (7, 30, 20), (3, 3, 3), (11, 0, 9), (8, 8, 8)]
    )
    together = runner.generate(items, gen)
    for i in (0, 4, 6):
        assert torch.equal(runner.generate([items[i]], gen)[0], together[i]), i
    reseeded = GenItem(items[0].prompt_ids, items[0].ref_tokens, items[0].target_len, seed=5)
    assert not torch.equal(runner.generate([reseeded], gen)[0], together[0])


def test_a_packed_batch_generates_alike_each_time_and_stays_as_packed(tiny):
    """generate_packed writes its tokens into the device batch; on the CPU that batch once was the
    HostBatch's own tensors, so a second run of the same HostBatch started with every target filled in."""
    _, model = load_model(tiny)
    runner = Runner(model, EngineConfig(), "cpu", torch.float32)
    gen = GenerationConfig(num_step=4)
    host = runner.pack(make_items([(9, 14, 12), (5, 0, 7)]))
    before = host.packed.input_ids.clone()
    first = runner.generate_packed(host, gen)
    assert torch.equal(host.packed.input_ids, before)
    for a, b in zip(first, runner.generate_packed(host, gen)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(target_len=0), "target_len=0"),
        (dict(prompt_ids=[]), "prompt_ids"),
        (dict(prompt_ids=[5, 10**6]), "prompt_ids"),
        (dict(ref_tokens=torch.zeros(4, 10, dtype=torch.long)), r"shape \(4, 10\)"),
        (dict(ref_tokens=torch.full((8, 3), 1024)), r"\[1024, 1024\]"),
        (dict(ref_tokens=torch.zeros(8, 0, dtype=torch.long)), r"shape \(8, 0\)"),
    ],
)
def test_bad_items_are_refused_by_name(tiny, change, message):
    _, model = load_model(tiny)
    good = make_items([(5, 4, 6), (4, 0, 3)])
    bad = dataclasses.replace(good[0], **change)
    with pytest.raises(InputError, match=rf"item 1: .*{message}"):
        Runner(model, EngineConfig(), "cpu", torch.float32).generate(
            [good[1], bad], GenerationConfig(num_step=2)
        )


def test_layout_picks_the_smallest_bucket():
    items = make_items([(10, 20, 30), (6, 0, 11)])
    assert sum(map(Runner.packed_tokens, items)) == 118
    layout = choose_layout(items, (512, 64, 256))
    assert layout.tokens == 256
    assert layout.max_seqlen == 64
    assert layout.sequences == 8  # 4 sequences, slots rounded up to a power of two (at least 8)
    assert choose_layout(make_items([(10, 20, 30)] * 5), (1024,)).sequences == 16
    assert choose_layout(items, (64,)) is None


@pytest.mark.gpu
def test_graph_replay_equals_eager_forward_on_new_inputs(tiny):
    _, model = load_model(tiny, device="cuda", dtype=torch.bfloat16)
    first, second = make_items([(9, 14, 12), (5, 0, 7)], seed=1), make_items([(12, 6, 16), (4, 0, 9)], seed=2)
    layout = choose_layout(first, (256,))
    assert layout == choose_layout(second, (256,))
    with torch.inference_mode():
        graphed = GraphedForward(model, pack_items(first, C, 1024, layout).to("cuda"), pool=None)
        for items in (second, first):
            batch = pack_items(items, C, 1024, layout).to("cuda")
            targets = batch.target_index  # the items' exact target rows (fewer than 64)
            batch.input_ids[:, targets] = torch.randint(0, 1024, (C, len(targets)), device="cuda")
            replayed = graphed(graphed.load(batch)).clone()
            real = int(batch.cu_seqlens[-1])  # padding rows are in no sequence: their values are undefined
            assert torch.equal(replayed[:real], model.hidden_states(batch)[:real])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_graph_generation_equals_eager(tiny, dtype):
    _, model = load_model(tiny, device="cuda", dtype=dtype)
    gen = GenerationConfig(num_step=8, position_temperature=5.0, class_temperature=0.5)
    batches = [make_items([(9, 14, 12), (5, 0, 7), (12, 6, 16)], seed=1), make_items([(7, 30, 40)], seed=2)]
    buckets = (256, 1024)
    graphed = Runner(model, EngineConfig(cuda_graphs=True, buckets=buckets), "cuda", dtype)
    eager = Runner(model, EngineConfig(cuda_graphs=False, buckets=buckets), "cuda", dtype)
    assert graphed.use_graphs and not eager.use_graphs
    for items in batches + batches:  # the second round replays the graphs captured in the first
        for a, b in zip(graphed.generate(items, gen), eager.generate(items, gen)):
            assert torch.equal(a, b)
    assert len(graphed.graphs) == 2


@pytest.mark.gpu
def test_graphs_captured_ahead_serve_the_batches_of_those_shapes(tiny):
    _, model = load_model(tiny, device="cuda", dtype=torch.bfloat16)
    items = make_items([(9, 14, 12), (5, 0, 7)], seed=4)
    runner = Runner(model, EngineConfig(cuda_graphs=True, buckets=(256, 1024)), "cuda", torch.bfloat16)
    shapes = [[(Runner.packed_tokens(i) - i.target_len, i.target_len) for i in items]]
    assert runner.capture(shapes) == 1 and runner.capture(shapes) == 0
    eager = Runner(model, EngineConfig(cuda_graphs=False, buckets=(256, 1024)), "cuda", torch.bfloat16)
    gen = GenerationConfig(num_step=4)
    for a, b in zip(runner.generate(items, gen), eager.generate(items, gen)):
        assert torch.equal(a, b)
    assert len(runner.graphs) == 1  # the batch replayed the graph captured ahead
