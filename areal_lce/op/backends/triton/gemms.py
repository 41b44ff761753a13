"""The backward's two cuBLAS products per vocab chunk (launch.py): d_weight[c0:c1] = d_logitsᵀ · h and
d_hidden += d_logits · W[c0:c1], in the most exact mode the device offers."""
from __future__ import annotations

import torch


_OUT_DTYPE_OK: dict = {}


def _out_dtype_supported(device: torch.device) -> bool:
    """torch.mm / torch.addmm with out_dtype=float32 on bf16/fp16 operands (CUDA, torch >= 2.8)."""
    key = str(device)
    if key not in _OUT_DTYPE_OK:
        ok = False
        if device.type == "cuda":
            try:
                a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
                c = torch.mm(a, a, out_dtype=torch.float32)
                torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
                ok = c.dtype == torch.float32 and bool((c == 32).all())
            except (TypeError, RuntimeError, NotImplementedError):
                ok = False
        _OUT_DTYPE_OK[key] = ok
    return _OUT_DTYPE_OK[key]


class Gemms:
    """The two cuBLAS products of one chunk, in the most exact mode the device offers.

    native     operands already in the workspace dtype (fp32 inputs, fp32 workspace)
    out_dtype  bf16/fp16 operands, fp32 output and accumulation (CUDA): d_hidden never rounds to bf16
    upcast     operands cast to fp32 first (CPU interpreter; CUDA without out_dtype support)
    """

    def __init__(self, hidden, weight, ws_dtype):
        self.hidden = hidden
        if ws_dtype == hidden.dtype:
            self.mode = "native" if hidden.dtype == torch.float32 else "out_dtype"
            if self.mode == "out_dtype" and not _out_dtype_supported(hidden.device):
                self.mode = "upcast"
        else:
            self.mode = "upcast"
        self._h32 = None

    def _h(self):
        if self.mode != "upcast" or self.hidden.dtype == torch.float32:
            return self.hidden
        if self._h32 is None:
            self._h32 = self.hidden.float()
        return self._h32

    def d_weight(self, dl, out):
        """out = dlᵀ · h in out's dtype: the weight's, or fp32 for bf16 / fp16 operands when the caller asks
        for an fp32 d_weight (LCEParams.d_weight_fp32): then the fp32 accumulation is not rounded."""
        h = self._h()
        if self.mode == "upcast":
            a = dl.t() if dl.dtype == torch.float32 else dl.t().float()
            if out.dtype == torch.float32:
                torch.mm(a, h, out=out)
            else:
                out.copy_(torch.mm(a, h))
        elif self.mode == "out_dtype" and out.dtype == torch.float32:
            torch.mm(dl.t(), h, out_dtype=torch.float32, out=out)
        else:
            torch.mm(dl.t(), h, out=out)

    def d_hidden(self, dl, w_chunk, dh, first: bool):
        if self.mode == "out_dtype":
            if first:
                torch.mm(dl, w_chunk, out_dtype=torch.float32, out=dh)
            else:
                torch.addmm(dh, dl, w_chunk, out_dtype=torch.float32, out=dh)
            return
        a = dl if dl.dtype == torch.float32 else dl.float()
        b = w_chunk if w_chunk.dtype == torch.float32 else w_chunk.float()
        if first:
            torch.mm(a, b, out=dh)
        else:
            dh.addmm_(a, b)
