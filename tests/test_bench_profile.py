"""bench/profile_generate.py on the CPU: the kernel-name classifier on real kernel names, the per-category
and top-kernel summary of hand-made profiler rows, the busy-time union, the graph-replay check, and the
script's refusals (unknown case, no GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from bench.profile_generate import (
    CATEGORIES,
    busy_us,
    classify,
    graph_kernels_recorded,
    main,
    parse_cases,
    summarize,
)
from engine.errors import InputError

NAMES = {
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn": "dense_gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
    "kernel__5x_cublas": "dense_gemm",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "dense_gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)": "dense_gemm",
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
    "cutlass::bfloat16_t>, false, true>(flash::Flash_fwd_params)": "attention",
    "void pytorch_flash::flash_fwd_kernel<...>": "attention",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)": (
        "norm_rope_elementwise"
    ),
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, "
    "float, float>, unsigned int, float, 4> >(...)": "norm_rope_elementwise",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "norm_rope_elementwise",
    "void qk_norm_rope_kernel<__nv_bfloat16>(...)": "norm_rope_elementwise",
    "void at::native::(anonymous namespace)::sort_postprocess_kernel<float>(...)": "sampling_decoding",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
    "unsigned int, long, 4> >(...)": "sampling_decoding",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(...)": "sampling_decoding",
    "void at::native::_scatter_gather_elementwise_kernel<128, 4, ...>": "sampling_decoding",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, "
    "true>(...)": "sampling_decoding",
    "void w4a4::(anonymous namespace)::quantize_act_lora_down_kernel<__nv_bfloat16, 4>(...)": "w4a4_quantize",
    "void w4a4::(anonymous namespace)::w4a4_gemm_lora_up_kernel<128>(...)": "w4a4_gemm",
    "void w4a4::(anonymous namespace)::fp8_quantize_kernel<__nv_bfloat16, 1>(...)": "fp8_quantize",
    "void w4a4::(anonymous namespace)::fp8_silu_mul_rows_kernel<__nv_bfloat16, 2>(...)": "fp8_quantize",
    "_swiglu_gemm_kernel": "dense_gemm",  # engine/kernels/swiglu.py (Triton): a GEMM with its SiLU epilogue
    "Memcpy HtoD (Pageable -> Device)": "memcpy_memset",
    "Memset (Device)": "memcpy_memset",
    "void some_library::mystery_kernel(float*)": "other",
}


@pytest.mark.parametrize("name", list(NAMES))
def test_classify_real_kernel_names(name):
    assert classify(name) == NAMES[name]


def test_summary_totals_categories_and_top_kernels():
    rng = random.Random(0)
    names = list(NAMES)
    rows = [(rng.choice(names), rng.uniform(1.0, 500.0), rng.randint(1, 3)) for _ in range(400)]
    s = summarize(rows, top=5)
    total = sum(us for _, us, _ in rows)
    assert s["device_us"] == pytest.approx(total, abs=0.1)
    assert set(s["categories"]) == set(CATEGORIES)
    for category, got in s["categories"].items():
        mine = [(us, n) for name, us, n in rows if NAMES[name] == category]
        assert got["us"] == pytest.approx(sum(us for us, _ in mine), abs=0.1)
        assert got["count"] == sum(n for _, n in mine)
        assert got["share"] == pytest.approx(got["us"] / total, abs=1e-4)
    assert s["kernels"] == sum(n for name, _, n in rows if NAMES[name] != "memcpy_memset")
    per_name: dict[str, list[float]] = {}
    for name, us, n in rows:
        per_name.setdefault(name, []).append((us, n))
    by_time = sorted(per_name, key=lambda k: sum(us for us, _ in per_name[k]), reverse=True)[:5]
    assert [k["name"] for k in s["top_kernels"]] == by_time
    for k in s["top_kernels"]:
        us, n = sum(u for u, _ in per_name[k["name"]]), sum(c for _, c in per_name[k["name"]])
        assert k["count"] == n and k["category"] == NAMES[k["name"]]
        assert k["mean_us"] == pytest.approx(us / n, abs=0.01)


def test_summary_of_no_rows_is_empty():
    s = summarize([])
    assert s["device_us"] == 0 and s["kernels"] == 0 and s["top_kernels"] == []
    assert all(c == {"us": 0.0, "count": 0, "share": 0.0} for c in s["categories"].values())


def test_busy_time_merges_overlaps_and_counts_gaps_out():
    assert busy_us([]) == 0.0
    assert busy_us([(10.0, 20.0), (0.0, 5.0), (15.0, 30.0), (18.0, 22.0), (40.0, 41.0)]) == 26.0
    rng = random.Random(1)
    intervals = [(s, s + rng.randint(1, 9)) for s in (rng.randint(0, 200) for _ in range(60))]
    covered = {t for s, e in intervals for t in range(s, e)}  # unit cells [t, t+1)
    assert busy_us([(float(s), float(e)) for s, e in intervals]) == len(covered)


def test_graph_check_needs_gemms_from_every_replay():
    with_gemms = summarize([("nvjet_tst_128x256", 50.0, 28 * 7 * 32), ("Memset (Device)", 1.0, 32)])
    only_decoding = summarize([("void at::native::sort_kernel", 50.0, 32), ("Memset (Device)", 1.0, 32)])
    assert graph_kernels_recorded(with_gemms["categories"], 32) is True
    assert graph_kernels_recorded(only_decoding["categories"], 32) is False
    assert graph_kernels_recorded(only_decoding["categories"], 0) is None


def test_cases_are_checked():
    assert parse_cases("B8_same, B32_vary") == ["B8_same", "B32_vary"]
    with pytest.raises(InputError, match="B9_odd"):
        parse_cases("B8_same,B9_odd")
    with pytest.raises(InputError, match="choose from"):
        parse_cases(" , ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_main_refuses_without_a_gpu(tmp_path):
    out = tmp_path / "profile.json"
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["--out", str(out)])
    assert not out.exists()
