"""Probe: what the device's Triton / Gluon offers for thread-block clusters on sm_90 (2-CTA launch, CTA-tiled
layouts, TMA multicast, cluster-scope mbarriers): the API surface, and whether a 2-CTA Gluon kernel compiles and
runs."""
import dataclasses, inspect, traceback, torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper as H
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier

print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
print("tma.async_copy_global_to_shared", inspect.signature(tma.async_copy_global_to_shared))
print("mbarrier.arrive", inspect.signature(mbarrier.arrive))
print("mbarrier exports", sorted(n for n in dir(mbarrier) if not n.startswith("_")))
print("hopper exports", sorted(n for n in dir(H) if not n.startswith("_")))
for cls in (gl.BlockedLayout, gl.NVMMASharedLayout, gl.NVMMADistributedLayout):
    print(cls.__name__, [f.name for f in dataclasses.fields(cls)])
try:
    from triton.experimental.gluon.language.nvidia.hopper import cluster
    print("hopper.cluster", sorted(n for n in dir(cluster) if not n.startswith("_")))
except Exception as e:
    print("hopper.cluster: not importable:", type(e).__name__, e)

fields = [f.name for f in dataclasses.fields(gl.BlockedLayout)]


def split_layout():
    if "cga_layout" in fields:
        return gl.BlockedLayout([1], [32], [4], [0], cga_layout=[[1]])
    return gl.BlockedLayout([1], [32], [4], [0], ctas_per_cga=[2], cta_split_num=[2], cta_order=[0])


@gluon.jit
def two_cta_copy(x, out, N: gl.constexpr, L: gl.constexpr):
    o = gl.arange(0, N, layout=L)
    gl.store(out + o, gl.load(x + o) + 1.0)


x = torch.arange(512, device="cuda", dtype=torch.float32)
out = torch.zeros_like(x)
try:
    two_cta_copy[(1,)](x, out, 512, split_layout(), num_warps=4, num_ctas=2)
    torch.cuda.synchronize()
    print("2-CTA gluon kernel ran; correct:", torch.equal(out, x + 1))
except Exception as e:
    print("2-CTA gluon kernel failed:", type(e).__name__, str(e)[:600])
    traceback.print_exc(limit=3)
