"""Host time per function (inclusive, per call) without a profiler: wrappers with perf_counter, GPU queue kept busy."""
import sys, time, collections, importlib, torch
sys.path.insert(0, ".")
import areal_lce, triton
from areal_lce import linear_logprobs_entropy
from benchmark.op.bench_invariant import inputs
from benchmark.op.bench_select import _sel
from host_prof import make

T = collections.defaultdict(float)
C = collections.defaultdict(int)


def wrap(fn, name):
    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[name] += time.perf_counter() - t0
            C[name] += 1
    w.__wrapped_timer__ = True
    return w


targets = {
    "areal_lce.api": ["prepare_call"], "areal_lce.library": ["lce", "_setup_context", "_backward", "decode"],
    "areal_lce.function": ["lce_forward", "lce_backward", "_check_values", "merge_shard_stats", "finish_stats",
                           "partition_rows", "empty_extras"],
    "areal_lce.select": ["forward_outputs", "selected_logits", "topk_keys", "check_selected_ids", "_segment_maxima",
                         "local_columns", "sparse_grad", "key_value", "key_id"],
    "areal_lce.exact": ["merge"],
    "areal_lce.backends.triton.select_launch": ["rank_segments", "candidate_topk", "_listed_tasks", "selected_plan",
                                                "pair_logits", "gather_logits"],
}
mods = [m for n, m in list(sys.modules.items()) if n.startswith("areal_lce")]
for modname, names in targets.items():
    mod = importlib.import_module(modname)
    for nm in names:
        fn = getattr(mod, nm, None)
        if fn is None:
            print("missing", modname, nm); continue
        wr = wrap(fn, f"{modname.split('.')[-1]}.{nm}")
        for m in list(sys.modules.values()):
            if m is None or not getattr(m, "__name__", "").startswith("areal_lce"):
                continue
            for an, av in list(vars(m).items()):
                if av is fn:
                    setattr(m, an, wr)
from areal_lce.select import SparseGrad
for nm in ("of", "columns", "apply"):
    raw = SparseGrad.__dict__[nm]
    if isinstance(raw, classmethod):
        setattr(SparseGrad, nm, classmethod(wrap(raw.__func__, f"SparseGrad.{nm}")))
    else:
        setattr(SparseGrad, nm, wrap(raw, f"SparseGrad.{nm}"))
from areal_lce.backends import get_backend
be = type(get_backend("triton"))
for nm in ("forward", "backward", "fold_segments", "finish_folded", "record_labels", "pair_logits", "gather_logits",
           "rank_segments", "candidate_topk"):
    for klass in be.__mro__:
        if nm in vars(klass):
            raw = vars(klass)[nm]
            if isinstance(raw, staticmethod):
                setattr(be, nm, staticmethod(wrap(raw.__func__, f"backend.{nm}")))
            else:
                setattr(be, nm, wrap(raw, f"backend.{nm}"))
            break
from triton.runtime.jit import JITFunction
JITFunction.run = wrap(JITFunction.run, "triton.run")
torch.Tensor.backward = wrap(torch.Tensor.backward, "Tensor.backward")

n, h, v = 4096, 896, 151936
hid, w, y = inputs(n, h, v)
hid.requires_grad_(); w.requires_grad_()
for tag, kw, bwd in (("base_f", {}, False), ("sel8_f", {"selected_ids": _sel(y, v, 8)}, False),
                     ("sel64_f", {"selected_ids": _sel(y, v, 64)}, False), ("top8_f", {"top_k": 8}, False),
                     ("top64_f", {"top_k": 64}, False), ("base_fb", {}, True), ("sel8_fb", {"selected_ids": _sel(y, v, 8)}, True),
                     ("sel64_fb", {"selected_ids": _sel(y, v, 64)}, True), ("top8_fb", {"top_k": 8}, True),
                     ("top64_fb", {"top_k": 64}, True)):
    f = make(hid, w, y, v, kw, bwd)
    for _ in range(3): f()
    torch.cuda.synchronize()
    T.clear(); C.clear()
    R = 10
    t0 = time.perf_counter()
    for _ in range(R):
        f()
    host = (time.perf_counter() - t0) / R * 1e3
    torch.cuda.synchronize()
    print(f"===== {tag} host/call {host:.3f} ms")
    for k, t in sorted(T.items(), key=lambda x: -x[1]):
        print(f"   {k:42s} {t / R * 1e3:7.3f} ms  x{C[k] / R:.0f}")
