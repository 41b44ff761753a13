"""What `bench_lce` writes and prints: bench_lce.{json,csv,png} stamped with the run's meta, the table
on stdout (ratios to the floors and to the targets, which are printed, not asserted), and the merge of
several result files into one CSV/PNG and the markdown tables of docs/benchmarks.md.
"""
from __future__ import annotations

import csv
import json
import os

from ..harness import log
from .lce_providers import PROVIDERS

# issue 12's kernel targets per shape (areal_triton with default options; cached: areal_triton_cache);
# None: no target at that shape
TARGETS = {"fwdbwd_x8": {"small": 1.10, "qwen7b": 1.00, "llama8b": 1.00, "wide_n": 1.04},
           "fwd_x2": {"small": 1.15, "qwen7b": 1.03, "llama8b": 1.03, "wide_n": 1.03},
           "cache_x8": {"small": None, "qwen7b": 0.80, "llama8b": 0.80, "wide_n": 0.90},
           "mem_gib_wide_n": 0.5, "logp": 2e-4, "ent": 5e-4, "dh": 2e-3, "dw": 2e-3}


def _fmt(v, f):
    return (f % v) if isinstance(v, (int, float)) else "-"


def csv_rows(results, m) -> list:
    rows = []
    for s in results:
        for p, r in s["providers"].items():
            rows.append({
                "shape": s["shape"], "N": s["N"], "H": s["H"], "V": s["V"], "provider": p,
                "fwd_ms": r.get("fwd", {}).get("ms"), "fwdbwd_ms": r.get("fwdbwd", {}).get("ms"),
                "fwdbwd_p20": r.get("fwdbwd", {}).get("p20"), "fwdbwd_p80": r.get("fwdbwd", {}).get("p80"),
                "fwd_x_floor": r.get("fwd_x_floor"), "fwdbwd_x_8nhv": r.get("fwdbwd_x_8nhv"),
                "fwdbwd_peak_extra_gib": r.get("fwdbwd_peak_extra_gib"), "fwd_peak_extra_gib": r.get("fwd_peak_extra_gib"),
                "logp_maxabs": r.get("logp_maxabs"), "ent_maxabs": r.get("ent_maxabs"),
                "dh_rel": r.get("dh_rel"), "dw_rel": r.get("dw_rel"),
                "floor_fwd_ms": s["floors"]["floor_fwd"], "floor_8nhv_ms": s["floors"]["floor_8nhv"],
                "floor_6nhv_ms": s["floors"]["floor_6nhv"], "error": r.get("error"),
                "device": m["device"], "git_sha": m.get("git_sha"),
            })
    return rows


def plot(results, rows, path, device):
    """Bars of fwd+bwd time over the 8NHV floor, per shape and provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    provs = [p for p in PROVIDERS if any(r["provider"] == p and r["fwdbwd_x_8nhv"] for r in rows)]
    width = 0.8 / max(1, len(provs))
    for i, p in enumerate(provs):
        xs, ys = [], []
        for j, s in enumerate(results):
            r = s["providers"].get(p, {})
            if r.get("fwdbwd_x_8nhv"):
                xs.append(j + i * width)
                ys.append(r["fwdbwd_x_8nhv"])
        ax.bar(xs, ys, width, label=p)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(results))])
    ax.set_xticklabels([f"{s['N']}x{s['H']}x{s['V']}" for s in results])
    ax.set_ylabel("fwd+bwd time / 8NHV cuBLAS floor")
    ax.set_title(f"fused linear logprobs+entropy, bf16, {device}")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(results, out_dir, m):
    """bench_lce.json (meta, targets, every measurement), bench_lce.csv (one row per shape and provider)
    and bench_lce.png under out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_lce.json"), "w") as f:
        json.dump({"meta": m, "targets": TARGETS, "shapes": results}, f, indent=1, default=str)
    rows = csv_rows(results, m)
    if rows:
        with open(os.path.join(out_dir, "bench_lce.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    try:
        plot(results, rows, os.path.join(out_dir, "bench_lce.png"), m["device"])
    except Exception as e:  # noqa: BLE001
        log("plot failed", e)


def print_table(results):
    hdr = f"{'shape':>22} {'provider':>19} {'fwd ms':>8} {'x2NHV':>6} {'f+b ms':>8} {'x8NHV':>6} {'GiB':>6} " \
          f"{'|dlogp|':>8} {'|dent|':>8} {'dh rel':>8} {'dW rel':>8}"
    print(hdr)
    fmt = _fmt
    for s in results:
        for p, r in s["providers"].items():
            print(f"{s['N']}x{s['H']}x{s['V']:>6} {p:>19} {fmt(r.get('fwd', {}).get('ms'), '%8.2f')} "
                  f"{fmt(r.get('fwd_x_floor'), '%6.2f')} {fmt(r.get('fwdbwd', {}).get('ms'), '%8.2f')} "
                  f"{fmt(r.get('fwdbwd_x_8nhv'), '%6.2f')} {fmt(r.get('fwdbwd_peak_extra_gib'), '%6.2f')} "
                  f"{fmt(r.get('logp_maxabs'), '%8.1e')} {fmt(r.get('ent_maxabs'), '%8.1e')} "
                  f"{fmt(r.get('dh_rel'), '%8.1e')} {fmt(r.get('dw_rel'), '%8.1e')}"
                  + (f"  [{r['error'][:60]}]" if r.get("error") else ""))
        fl = s["floors"]
        print(f"{'':>22} {'floors':>19} fwd {fl['floor_fwd']:.2f} ms, 8NHV {fl['floor_8nhv']:.2f} ms, "
              f"6NHV {fl['floor_6nhv']:.2f} ms ({fl['fwd_tflops']:.0f} TFLOP/s)")
        if "breakdown" in s:
            print(f"{'':>22} {'triton breakdown':>19} " + ", ".join(f"{k} {v:.2f}" for k, v in s["breakdown"].items()
                                                                   if isinstance(v, float)))
        tr = s["providers"].get("areal_triton", {})
        tc = s["providers"].get("areal_triton_cache", {})
        tn = s["providers"].get("areal_triton_nochecks", {})
        tgt = {k: TARGETS[k].get(s["shape"]) for k in ("fwdbwd_x8", "fwd_x2", "cache_x8")}
        if tr.get("fwdbwd_x_8nhv"):
            print(f"{'':>22} {'vs targets':>19} "
                  f"fwd+bwd {tr['fwdbwd_x_8nhv']:.2f}/{_fmt(tgt['fwdbwd_x8'], '%.2f')} x8NHV, "
                  f"fwd {tr['fwd_x_floor']:.2f}/{_fmt(tgt['fwd_x2'], '%.2f')}"
                  + (f" ({tn['fwd_x_floor']:.2f} checks off)" if tn.get("fwd_x_floor") else "")
                  + (f", cached {tc['fwdbwd_x_8nhv']:.2f}/{_fmt(tgt['cache_x8'], '%.2f')}"
                     if tc.get("fwdbwd_x_8nhv") else ""))


def merge(files, out_dir):
    """Combine result files (e.g. two device runs) into one CSV/PNG and a markdown table on stdout."""
    results, metas = [], []
    for f in files:
        with open(f) as fh:
            d = json.load(fh)
        metas.append(d["meta"])
        for s in d["shapes"]:
            s["source"] = f"{os.path.basename(os.path.dirname(f))} ({d['meta'].get('git_sha', '?')})"
            results.append(s)
    m = dict(metas[0])
    m["git_sha"] = ",".join(sorted({x.get("git_sha", "?") for x in metas}))
    write_outputs(results, out_dir, m)
    print_markdown(results)
    return 0


def print_markdown(results):
    """The two markdown tables of docs/benchmarks.md: providers, then floors and the Triton breakdown."""
    f2 = _fmt
    print("| N×H×V | provider | fwd ms | ×2NHV | fwd+bwd ms (p20–p80) | ×8NHV | extra GiB | max abs Δlogp | "
          "max abs Δent | dh rel-L2 | dW rel-L2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in results:
        for p, r in s["providers"].items():
            fb = r.get("fwdbwd", {})
            if r.get("error"):
                print(f"| {s['N']}×{s['H']}×{s['V']} | {p} | {r['error'][:40]} | | | | | | | | |")
                continue
            print(f"| {s['N']}×{s['H']}×{s['V']} | {p} | {f2(r['fwd']['ms'], '%.2f')} | {f2(r['fwd_x_floor'], '%.2f')} | "
                  f"{fb['ms']:.2f} ({fb['p20']:.2f}–{fb['p80']:.2f}) | {f2(r['fwdbwd_x_8nhv'], '%.2f')} | "
                  f"{f2(r['fwdbwd_peak_extra_gib'], '%.2f')} | {f2(r.get('logp_maxabs'), '%.1e')} | "
                  f"{f2(r.get('ent_maxabs'), '%.1e')} | {f2(r['dh_rel'], '%.2e')} | {f2(r['dw_rel'], '%.2e')} |")
    print()
    print("| N×H×V | fwd GEMM ms | 8NHV floor ms | 6NHV floor ms | Triton fwd ms | recompute kernel ms | cuBLAS dh+dW ms | source |")
    print("|---|---|---|---|---|---|---|---|")
    for s in results:
        fl, bd = s["floors"], s.get("breakdown", {})
        print(f"| {s['N']}×{s['H']}×{s['V']} | {fl['fwd_gemm']:.2f} | {fl['floor_8nhv']:.2f} | {fl['floor_6nhv']:.2f} | "
              f"{f2(bd.get('fwd_backend'), '%.2f')} | {f2(bd.get('bwd_kernel_only'), '%.2f')} | "
              f"{f2(bd.get('bwd_gemms'), '%.2f')} | {s['source']} |")
