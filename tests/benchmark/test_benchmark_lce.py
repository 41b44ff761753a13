"""benchmark.op.bench_lce on a tiny shape: its exact fp32 reference against fp64, and one run of the
measurement path and of the tile sweep (on CPU: host-timed, the Triton providers in the interpreter).
The GPU run is `python -m benchmark.op.bench_lce`; this checks the script, not its times.
"""
import json

import pytest
import torch

from areal_lce.op import reference
from benchmark.op import bench_lce
from benchmark.harness import exact_reference
from helpers.kernel_device import kernel_device

DEVICE = str(kernel_device() or "cpu")  # the Triton providers: the interpreter on CPU, else the kernels on CUDA
SHAPE = "40x32x384"


def _fp64(h, W, y, with_ent):
    """areal_lce.op.reference in fp64, gradients of loss = -sum(logp) [- sum(entropy)] by autograd."""
    h, W = h.double().requires_grad_(), W.double().requires_grad_()
    ref = reference.logprobs_entropy(h, W, y)
    (-ref.logprobs.sum() - (ref.entropy.sum() if with_ent else 0)).backward()
    return {"logp": ref.logprobs.detach(), "ent": ref.entropy.detach(), "dh": h.grad, "dW": W.grad}


@pytest.mark.parametrize("with_ent", [True, False])
def test_exact_reference_is_fp32_exact(with_ent):
    """The benchmark's accuracy oracle: within fp32 rounding of fp64, chunked rows (ragged last chunk)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(40, 32, generator=g).to(torch.bfloat16)
    W = (torch.randn(384, 32, generator=g) * 0.7).to(torch.bfloat16)
    W[:6] = h[:6] * 0.8  # peaked rows: p(label) ~ 1
    y = torch.randint(0, 384, (40,), generator=g)
    y[:6] = torch.arange(6)
    ref, exact = exact_reference(h.to(DEVICE), W.to(DEVICE), y.to(DEVICE), with_ent, chunk=16), _fp64(h, W, y, with_ent)
    assert (ref["logp"].cpu().double() - exact["logp"]).abs().max() < 1e-5
    assert (ref["ent"].cpu().double() - exact["ent"]).abs().max() < 1e-5
    for k in ("dh", "dW"):
        err = (ref[k].cpu().double() - exact[k]).norm() / exact[k].norm()
        assert err < 1e-6, (k, err.item())  # a bf16 rounding anywhere would show as ~1e-3


@pytest.mark.slow
def test_run_measures_every_provider_against_the_reference(tmp_path, capsys):
    argv = ["--device", DEVICE, "--shapes", SHAPE, "--providers", "areal_triton,areal_torch,torch_eager",
            "--rep", "1", "--out", str(tmp_path)]
    assert bench_lce.main(argv) == 0
    out = json.loads((tmp_path / "bench_lce.json").read_text())
    assert "git_sha" in out["meta"] and "torch" in out["meta"]
    (shape,) = out["shapes"]
    assert (shape["N"], shape["H"], shape["V"]) == (40, 32, 384)
    provs = shape["providers"]
    for name in ("areal_triton", "areal_torch"):
        r = provs[name]
        assert "error" not in r, r
        assert r["logp_maxabs"] < 1e-4 and r["ent_maxabs"] < 1e-4, r
        assert r["dh_rel"] < 5e-3 and r["dw_rel"] < 5e-3, r  # bf16 gradients: ~2e-3 rounding
        assert r["fwd"]["ms"] > 0 and r["fwdbwd_x_8nhv"] > 0
        # default --rounds 3: each ratio is the median of three GEMM-paired rounds
        assert len(r["fwd_x_gemm_rounds"]) == len(r["fwdbwd_x_8nhv_rounds"]) == len(r["gemm_ms_rounds"]) == 3
        assert r["fwd_x_floor"] == sorted(r["fwd_x_gemm_rounds"])[1]
        assert r["fwdbwd_x_8nhv"] == sorted(r["fwdbwd_x_8nhv_rounds"])[1]
    assert provs["torch_eager"]["logp_maxabs"] > 1e-3  # bf16 logits: the reference tells them apart
    assert set(shape["breakdown"]) == {"fwd_backend", "op_fwd_over_backend", "bwd_backend", "bwd_kernel_only",
                                       "bwd_gemms"}
    assert 0.2 < shape["breakdown"]["op_fwd_over_backend"] < 50  # a ratio of two timings of one call each
    assert (tmp_path / "bench_lce.csv").read_text().count("\n") == 1 + 3
    printed = capsys.readouterr().out
    assert "triton breakdown" in printed and "vs targets" in printed


@pytest.mark.slow
def test_sweep_runs_every_candidate(tmp_path):
    assert bench_lce.main(["--device", DEVICE, "--sweep", "--shapes", SHAPE, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert len(rows) == 7 and not [r for r in rows if "error" in r], rows
    assert {(r["kind"], r["tma"], r["pps"]) for r in rows} >= {("fwd", False, 1), ("bwd", True, 2)}


@pytest.mark.slow
def test_bench_ignored_layouts_and_run(tmp_path):
    """benchmark.op.bench_ignored: its label layouts mask what they say, and one CPU run of every layout."""
    from benchmark.op import bench_ignored

    y = torch.arange(544)
    rl = bench_ignored.layout_labels(y, "rl_256_16")  # two sequences of 272: 16 targets each, at their ends
    assert (rl != -100).sum() == 32 and (rl[256:272] == y[256:272]).all() and (rl[:256] == -100).all()
    sc = bench_ignored.layout_labels(y, "scattered_0.5")
    assert 0.4 < (sc == -100).float().mean() < 0.6 and ((sc == y) | (sc == -100)).all()
    assert torch.equal(bench_ignored.layout_labels(y, "all"), y)
    with pytest.raises(ValueError, match="layout 'rl'"):
        bench_ignored.layout_labels(y, "rl")
    argv = ["--device", "cpu", "--shapes", "288x32x384", "--backend", "torch", "--rep", "1", "--out", str(tmp_path)]
    assert bench_ignored.main(argv) == 0
    (shape,) = json.loads((tmp_path / "bench_ignored.json").read_text())["shapes"]
    assert set(shape["layouts"]) == set(bench_ignored.LAYOUTS)
    rl = shape["layouts"]["rl_256_16"]
    assert rl["ignored_share"] == pytest.approx(1 - 16 / 288)  # one whole sequence and 16 prompt rows
    assert rl["compact_fwd_ms"] > 0 and rl["in_place_fwdbwd_over_all"] > 0
