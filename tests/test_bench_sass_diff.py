"""bench/sass_diff.py's parsing, on hand-made ptxas and nvdisasm output: kernel names without the anonymous
namespace's path hash, registers and spills per kernel, machine code compared without addresses or label
numbers, and the static size of each loop."""

from __future__ import annotations

from bench.sass_diff import Resources, kernel_bodies, loop_sizes, parse_ptxas_log, short_name

GEMM_A = "_ZN4w4a445_GLOBAL__N__36fd774d_12_w4a4_gemm_cu_d6ea3d4e24w4a4_gemm_lora_up_kernelILi256EEEvPKa"
GEMM_B = "_ZN4w4a445_GLOBAL__N__0a1b2c3d_12_w4a4_gemm_cu_9f8e7d6c24w4a4_gemm_lora_up_kernelILi256EEEvPKa"
QUANT = (
    "_ZN4w4a448_GLOBAL__N__36fd774d_15_quantize_act_cu_14252d2429quantize_act_lora_down_kernelILi96EEEvPKT"
)


def test_short_name_drops_the_path_hash_only():
    assert short_name(GEMM_A) == short_name(GEMM_B)
    assert short_name(GEMM_A).endswith("w4a4_gemm_lora_up_kernelILi256EEEvPKa")
    assert short_name(GEMM_A) != short_name(GEMM_A.replace("Li256", "Li128"))


def test_parse_ptxas_log_reads_registers_and_spills_per_kernel():
    log = f"""ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '{GEMM_A}' for 'sm_90a'
ptxas info    : Function properties for {GEMM_A}
    16 bytes stack frame, 32 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 16 bytes cumulative stack size
ptxas info    : Compiling entry function '{QUANT}' for 'sm_90a'
ptxas info    : Function properties for {QUANT}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 127 registers, used 1 barriers, 40896 bytes smem
"""
    assert parse_ptxas_log(log) == {
        short_name(GEMM_A): Resources(168, 32, 24),
        short_name(QUANT): Resources(127, 0, 0),
    }


def sass(symbol: str, label: int, address: int, opcode: str) -> str:
    return f"""
	.text.{symbol}:
        /*{address:04x}*/                   {opcode} R24, R56, gdesc[UR8], RZ, !UPT ;
        /*{address + 16:04x}*/              @P0 BRA `(.L_x_{label}) ;
.L_x_{label}:
        /*{address + 32:04x}*/                   EXIT ;
"""


def test_kernel_bodies_compare_equal_across_builds_of_the_same_code():
    a = kernel_bodies("\t.headerflags\n" + sass(GEMM_A, 7, 0x1000, "QGMMA.64x256x32.F16.E4M3.E4M3"))
    b = kernel_bodies("\t.headerflags\n" + sass(GEMM_B, 31, 0x2A00, "QGMMA.64x256x32.F16.E4M3.E4M3"))
    c = kernel_bodies("\t.headerflags\n" + sass(GEMM_B, 31, 0x2A00, "QGMMA.64x128x32.F16.E4M3.E4M3"))
    assert list(a) == [short_name(GEMM_A)]
    assert a == b
    assert a != c


def test_loop_sizes_count_from_the_label_to_the_branch_back():
    body = kernel_bodies(
        f"""\t.headerflags
\t.text.{GEMM_A}:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_5:
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/               @P1 BRA `(.L_x_6) ;
        /*0030*/                   LDGSTS.E.BYPASS.128 [R4], desc[UR8][R6.64] ;
.L_x_6:
        /*0040*/                   HFMA2 R8, R2, R9, R8 ;
        /*0050*/               @P0 BRA `(.L_x_5) ;
        /*0060*/                   EXIT ;
.L_x_7:
        /*0070*/                   BRA `(.L_x_7);
        /*0080*/                   NOP;
"""
    )[short_name(GEMM_A)]
    assert loop_sizes(body) == [5]
