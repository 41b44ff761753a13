"""Probe: does this Triton's Gluon run a warp-specialised kernel (and import Hopper's wgmma / TMA / mbarrier) on sm_90?"""
import inspect, torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
print("triton", triton.__version__, torch.cuda.get_device_name())
print("warp_specialize signature:", inspect.signature(gl.warp_specialize))
try:
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait, tma, mbarrier  # noqa
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa
    print("hopper wgmma / tma / mbarrier / TensorDescriptor: importable")
except Exception as e:
    print("hopper imports failed:", type(e).__name__, e)


@gluon.jit
def _add_one(x, out, N: gl.constexpr, NW: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    o = gl.arange(0, N, layout=layout)
    gl.store(out + o, gl.load(x + o) + 1.0)


@gluon.jit
def _times_two(x, out, N: gl.constexpr, NW: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    o = gl.arange(0, N, layout=layout)
    gl.store(out + N + o, gl.load(x + o) * 2.0)


@gluon.jit
def ws_kernel(x, out, N: gl.constexpr):
    gl.warp_specialize([(_add_one, (x, out, N, 4)), (_times_two, (x, out, N, 1))], [1], [24])


@gluon.jit
def ws_kernel_old(x, out, N: gl.constexpr):
    gl.warp_specialize((x, out, N, 4), _add_one, (x, out, N, 1), [_times_two], [1], [24])


x = torch.arange(256, device="cuda", dtype=torch.float32)
for k in (ws_kernel, ws_kernel_old):
    out = torch.zeros(512, device="cuda")
    try:
        k[(1,)](x, out, 256, num_warps=4)
        torch.cuda.synchronize()
        ok = torch.equal(out[:256], x + 1) and torch.equal(out[256:], x * 2)
        print(k.fn.__name__ if hasattr(k, "fn") else k, "ran, results correct:", ok)
    except Exception as e:
        print("form failed:", type(e).__name__, str(e)[:300])
