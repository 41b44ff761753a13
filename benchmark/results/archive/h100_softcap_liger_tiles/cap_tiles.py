"""Forward / backward tile configs (2 programs per SM) at 4096x896: softcap and extras, ratio to the default call
without extras. python3 cap_tiles.py ROUNDS SHAPES [2]: with 2 the second set of forward tiles, forward only
(cap_tiles2.log); without it the first set, forward and fwd+bwd (cap_tiles.log)."""
import statistics, sys, torch
from areal_lce import linear_logprobs_entropy
from areal_lce.backends.triton import configs
from areal_lce.backends.triton.configs import TileConfig as T
from benchmark.op.bench_invariant import SHAPES, inputs, timed
from benchmark.harness import paired_ratios

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["small"]
FWD = {
    "d": None,
    "128x128w8r128": T(128, 128, 64, 16, 8, 3, 128),
    "128x128w4": T(128, 128, 64, 16, 4, 3),
    "128x128w4s4": T(128, 128, 64, 16, 4, 4),
    "64x256w4s2": T(64, 256, 64, 16, 4, 2),
    "128x256w8s2r128": T(128, 256, 64, 16, 8, 2, 128),
}
FWD2 = {
    "d": None,
    "128x128x64w4s3": T(128, 128, 64, 16, 4, 3),
    "64x256x32w4s4": T(64, 256, 32, 16, 4, 4),
    "64x256x32w4s3": T(64, 256, 32, 16, 4, 3),
    "128x128x32w4s4": T(128, 128, 32, 16, 4, 4),
    "128x128x32w4s5": T(128, 128, 32, 16, 4, 5),
    "64x128x64w4s3": T(64, 128, 64, 16, 4, 3),
    "64x256x64w4s2g32": T(64, 256, 64, 32, 4, 2),
}
SET2 = len(sys.argv) > 3 and sys.argv[3] == "2"
if SET2:
    FWD = FWD2
BWD = {
    "d": (None, None),
    "128x128w8r128p2": (T(128, 128, 64, 16, 8, 3, 128), 2),
    "128x128w4p2": (T(128, 128, 64, 16, 4, 3), 2),
    "128x128w4p3": (T(128, 128, 64, 16, 4, 2), 3),
}

def same_outputs(a, b, kw):
    """Whether two calls' forward outputs (logprobs, entropy; top-k ids and logprobs for a top-k call) are equal bitwise."""
    eq = all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("logprobs", "entropy"))
    if kw.get("top_k"):
        eq = eq and torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_logprobs, b.topk_logprobs)
    return eq


def bit_checks(fwd, keys, prefix=""):
    """Compare fwd(kw, key) with fwd(kw, "d") for the base, soft-capped and top-8 calls; print each verdict and
    return the keys whose base call matched."""
    ok = []
    for kw in ({}, {"softcap": 30.0}, {"top_k": 8}):
        a = fwd(kw, "d")
        for key in keys:
            try:
                eq = same_outputs(a, fwd(kw, key), kw)
                print(f"{prefix}{kw} {key} bitwise equal to default: {eq}", flush=True)
                if not kw and eq:
                    ok.append(key)
            except Exception as e:  # noqa: BLE001
                print(f"{prefix}{kw} {key} ERROR {type(e).__name__}: {str(e)[:400]}", flush=True)
    return ok


def time_forward(fwd, variants, rounds, prefix=""):
    """Time fwd(kw, key) for each (name, kw, key) in paired rounds; print each ratio to the first (the base)."""
    times = {vn: [] for vn, _, _ in variants}
    for _ in range(rounds):
        for vn, kw, key in variants:
            times[vn].append(timed(lambda: fwd(kw, key), 15))
    print(f"{prefix}fwd base {statistics.median(times['base']):.3f} ms", flush=True)
    for vn, _, _ in variants[1:]:
        rr, sp = paired_ratios(times[vn], times["base"])
        print(f"  fwd {vn:24s} {rr:.3f} [{sp[0]:.3f}-{sp[1]:.3f}] {statistics.median(times[vn]):.3f} ms", flush=True)


def main():
    for name in names:
        n, h, v = SHAPES[name]
        hid, w, y = inputs(n, h, v)
        hid.requires_grad_(); w.requires_grad_()
        g = torch.Generator(device="cuda").manual_seed(3)
        sel = torch.randint(0, v, (n, 64), device="cuda", generator=g)

        def fwd(kw, fc):
            with configs.tuning(fwd=FWD[fc]), torch.no_grad():
                return linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)

        def fwd_bwd(kw, fc, bc):
            c, p = BWD[bc]
            with configs.tuning(fwd=FWD[fc], bwd=c, bwd_programs_per_sm=p):
                o = linear_logprobs_entropy(hid, w, y, vocab_size=v, **kw)
                loss = o.logprobs.sum() + o.entropy.sum()
                loss.backward()
            out = (o.logprobs.detach(), hid.grad, w.grad)
            hid.grad = w.grad = None
            return out

        bit_checks(fwd, list(FWD)[1:], f"{name} fwd ")
        fv = [("base", {}, "d")] + [(f"cap_{fc}", {"softcap": 30.0}, fc) for fc in FWD] + \
             [(f"base_{fc}", {}, fc) for fc in list(FWD)[1:]] + \
             [(f"{x}_{fc}", kw, fc) for x, kw in (("sel64", {"selected_ids": sel}), ("top8", {"top_k": 8}),
                                                   ("top64", {"top_k": 64})) for fc in FWD]
        ok = []
        for vn, kw, fc in fv:
            try:
                fwd(kw, fc); ok.append((vn, kw, fc))
            except Exception as e:
                print(f"skip {vn}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        time_forward(fwd, ok, ROUNDS, f"{name} ")
        if SET2:
            continue
        bv = [("base", {}, "d", "d")] + [(f"cap_f{fc}_b{bc}", {"softcap": 30.0}, fc, bc) for fc in ("d", "128x128w4")
                                          for bc in BWD] + [(f"base_b{bc}", {}, "d", bc) for bc in list(BWD)[1:]] + \
             [("base_f128x128w4", {}, "128x128w4", "d")]
        ok = []
        for vn, kw, fc, bc in bv:
            try:
                fwd_bwd(kw, fc, bc); ok.append((vn, kw, fc, bc))
            except Exception as e:
                print(f"skip {vn}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        a = fwd_bwd({"softcap": 30.0}, "d", "d")
        for vn, kw, fc, bc in ok:
            if kw:
                b = fwd_bwd(kw, fc, bc)
                d = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a[1:], b[1:]))
                print(f"  {vn} grads max |diff| vs default {d:.3e}", flush=True)
        times = {vn: [] for vn, *_ in ok}
        for _ in range(ROUNDS):
            for vn, kw, fc, bc in ok:
                times[vn].append(timed(lambda: fwd_bwd(kw, fc, bc), 7))
        print(f"{name} fwd_bwd base {statistics.median(times['base']):.3f} ms", flush=True)
        for vn, *_ in ok[1:]:
            rr, sp = paired_ratios(times[vn], times["base"])
            print(f"  fb {vn:30s} {rr:.3f} [{sp[0]:.3f}-{sp[1]:.3f}] {statistics.median(times[vn]):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
