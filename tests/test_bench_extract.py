"""scripts/bench_extract.py's part 5 (the GPU benchmark that travels): its synthetic
inputs follow the recorded length quantiles, and its code runs, here on the CPU with
tiny shapes, printing padded and packed rows whose figures add up."""

from __future__ import annotations

import numpy as np
from conftest import load_script

be = load_script("bench_extract")


def test_synthetic_lengths_follow_the_recorded_quantiles():
    for name, (_, _, q) in be.LENGTH_QUANTILES.items():
        assert len(q) == 21 and q == sorted(q), name
        n = be.synthetic_lengths(name, 20000, seed=3)
        assert n.min() >= q[0] and n.max() <= q[-1]
        got = np.percentile(n, [25, 50, 75])
        want = np.array([q[5], q[10], q[15]])
        assert np.all(np.abs(got - want) <= 0.05 * want + 2), (name, got, want)
    a = be.synthetic_sequences("esm_proteins", 30, seed=7)
    assert a == be.synthetic_sequences("esm_proteins", 30, seed=7)  # same seed, same inputs
    assert a != be.synthetic_sequences("esm_proteins", 30, seed=8)
    assert [len(s) for s in a] == be.synthetic_lengths("esm_proteins", 30, seed=7).tolist()
    assert set("".join(a)) <= set("ACDEFGHIKLMNPQRSTVWY")


def test_device_part_runs_on_the_cpu(capsys):
    args = be.parse_args(
        ["--device", "cpu", "--device-shapes", "tiny,tiny_dna", "--device-sets", "esm_proteins,viral_proteins", "--device-dna-sets", "viral_reads",
         "--device-n", "40", "--device-dna-n", "20", "--alone-n", "8", "--profile-n", "10", "--repeats", "1"]
    )  # fmt: skip
    rows = be.part_device(args)
    out = capsys.readouterr().out
    assert "measured matmul rate" in out and out.count("varlen / padded:") == 3 and out.count("profile of varlen") == 3
    esm = ["varlen", "padded", "masked", "alone"]
    assert [(r["set"], r["path"]) for r in rows] == [(s, p) for s in ("esm_proteins", "viral_proteins") for p in esm] + [
        ("viral_reads", p) for p in ("varlen", "padded", "alone")
    ]
    for r in rows:
        assert r["sequences"] == (8 if r["path"] == "alone" else 20 if r["kind"] == "dnabert_s" else 40) and 0 <= r["padding"] < 1
        assert np.isclose(r["tokens_per_s"], r["tokens"] / r["seconds"]) and np.isclose(r["of_floor"], r["floor_seconds"] / r["seconds"])
    for r in rows:
        if r["path"] == "varlen":
            # no padding at all; the same vectors as one at a time (fp32 on the CPU)
            assert r["padding"] == 0 and r["attention"] == "segments"
            assert r["min_cosine"] > 1 - 1e-6
            # the profile's components are the profiled pass's operators, within its wall time
            assert set(r["profile"]) >= {"attention", "matmul", "host"}
    by = {(r["set"], r["path"]): r for r in rows}
    for s in ("esm_proteins", "viral_proteins", "viral_reads"):
        assert by[(s, "varlen")]["tokens"] == by[(s, "padded")]["tokens"]
        assert by[(s, "varlen")]["padding"] <= by[(s, "padded")]["padding"]


def test_quick_gpu_sets_the_short_version():
    args = be.parse_args(["--quick-gpu"])
    assert args.device == "cuda" and args.repeats == 1
    assert args.device_shapes.split(",") == ["650M", "3B", "esmc600M", "dnabert_s"]
    assert args.device_sets == "prodigal_proteins" and args.device_dna_sets == "viral_reads"


def test_profile_components_of_real_kernel_names():
    """Kernel names as CUDA traces of these models print them, each in its component;
    inductor's fused kernels name the operations they fuse (copy, cat) and are elementwise."""
    names = {
        "flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>": "attention",
        "triton_tem_fused_flex_attention_0": "attention",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>": "layer norm",
        "triton_red_fused_native_layer_norm_0": "layer norm",
        "triton_poi_fused__to_copy_cat_mul_neg_slice_0": "elementwise",
        "triton_per_fused_gelu_1": "elementwise",
        "void at::native::index_elementwise_kernel<128, 4>": "gather/copy",
        "Memcpy DtoD (Device -> Device)": "gather/copy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>": "elementwise",
    }
    assert {n: be.component(n) for n in names} == names
