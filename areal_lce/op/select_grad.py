"""The gradient of the selected-id and top-k logprobs (select.py) beyond what a backend's dense backward does.

d(z_j - lse)/dz = onehot_j - p. The dense part (-p per unit of upstream gradient) has the form of the
logprob's, so the backend's backward takes it through its g_lp; what is left is sparse: one coefficient per
(row, chosen column), applied as d_hidden += c · W_j and d_weight[j] += c · h (index_put_ with accumulate:
deterministic), or added to the backend's d_logits where it takes them (`takes_sparse`). A backend with
`fused_rows` builds the columns and coefficients in one launch (`sparse_columns`, base.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from .backends.base import cap_slope, head_transform
from .select import CHUNK_ELEMS, fused_rows, local_columns
from .types import LCEParams


def sparse_grad(hidden: Optional[torch.Tensor], weight: torch.Tensor, ids: torch.Tensor, coef: torch.Tensor,
                params: LCEParams, dh: Optional[torch.Tensor], dw: Optional[torch.Tensor]) -> None:
    """Add the sparse gradient of d_logits[n, ids[n, j]] = coef[n, j] (raw-logit units) to dh [N, H] and
    dw [V_shard, H] (fp32 / fp64 buffers) in place. ids: global ids; entries this shard does not own
    (or ignore_index) are skipped; a non-finite hidden row with zero coefficients contributes nothing."""
    loc, own = local_columns(ids, params)
    if params.softcap and ids.shape[1]:
        raw = head_transform(params.backend.gather_logits(hidden, weight, loc), params)
        coef = coef * cap_slope(raw, params)
    coef = torch.where(own, coef, torch.zeros_like(coef))
    n, j = ids.shape
    acc = dh.dtype if dh is not None else dw.dtype
    chunk = max(1, (CHUNK_ELEMS // 4) // max(1, j * hidden.shape[1]))
    for t0 in range(0, n, chunk):
        t1 = min(n, t0 + chunk)
        c = coef[t0:t1].to(acc)
        cl = loc[t0:t1]
        if dh is not None:
            dh[t0:t1] += torch.bmm(c[:, None, :], weight[cl].to(acc)).squeeze(1)
        if dw is not None:
            h = hidden[t0:t1].to(acc)
            contrib = torch.where(own[t0:t1, :, None], c[:, :, None] * h[:, None, :], 0.0)
            dw.index_put_((cl.reshape(-1),), contrib.reshape(-1, h.shape[1]), accumulate=True)


class SparseGrad:
    """The part of the backward that the backend's dense pass does not do (module docstring): the label,
    selected and top-k columns' coefficients, the logit sum's rank-one term, and the g_lp that carries the
    dense -p part of all of them."""

    def __init__(self, g, ids, coef, g_lsum, cols=None):
        self.g, self.ids, self.coef, self.g_lsum, self._cols = g, ids, coef, g_lsum, cols

    @classmethod
    def of(cls, labels, inv_t, params: LCEParams, g, g_dstats, selected_ids, g_sel, topk_ids, g_topk, acc):
        """None when only logprobs and entropy carry gradient (the backend does everything)."""
        if g_dstats is None and g_sel is None and g_topk is None:
            return None
        g_lsum = None
        if g_dstats is not None and g_dstats.shape[0] > 1:
            g_lsum = torch.where(labels != params.ignore_index, g_dstats[1].to(acc), 0.0)
        if acc == torch.float32 and fused_rows(params) and params.backend.takes_sparse:
            parts = tuple((ids, gc) if ids is not None and gc is not None else None
                          for ids, gc in ((selected_ids, g_sel), (topk_ids, g_topk)))
            g_out, cols, coef = params.backend.sparse_columns(labels, inv_t if inv_t is not None else params.inv_t,
                                                              params, g, g_dstats[0] if g_dstats is not None else None,
                                                              parts)
            return cls(g_out, None, None, g_lsum, (cols, coef))
        valid = labels != params.ignore_index
        ids, coefs = [], []
        dense = torch.zeros_like(g[0])  # Σ of the upstream gradients of every (z_j - lse) term
        g_lse = g_dstats[0].to(acc) if g_dstats is not None else torch.zeros_like(g[0])
        for col, gc in ((selected_ids, g_sel), (topk_ids, g_topk)):
            if col is None or gc is None:
                continue
            gc = torch.where(valid[:, None] & (col != params.ignore_index), gc.to(acc), 0.0)
            ids.append(col)
            coefs.append(gc)
            dense = dense + gc.sum(1)
        # d lse / dz = p = onehot(label) - d logprob / dz: lse's gradient is -g_lse through g_lp plus
        # g_lse at the label column; each (z_j - lse) adds its g to g_lp and to column j, minus at the label
        g_out = g.clone()
        g_out[0] = g[0] - g_lse + dense
        ids.insert(0, labels[:, None])
        coefs.insert(0, (g_lse - dense)[:, None])
        it = inv_t.to(acc)[:, None] if inv_t is not None else params.inv_t
        coef = torch.where(valid[:, None], torch.cat(coefs, 1) * it, 0.0)  # d_logits: dz · inv_t
        return cls(g_out, torch.cat(ids, 1), coef, g_lsum)

    def columns(self, hidden, weight, params: LCEParams):
        """(local columns [N, J] int64, -1 where this shard does not own the id; coefficients [N, J] fp32 in
        raw-logit units, softcap's slope included): what a backend adds to its d_logits (`takes_sparse`)."""
        if self._cols is not None:  # the backend's sparse_columns gave them
            return self._cols
        loc, own = local_columns(self.ids, params)
        coef = self.coef
        if params.softcap and self.ids.shape[1]:
            raw = head_transform(params.backend.gather_logits(hidden, weight, loc),
                                 params)
            coef = coef * cap_slope(raw, params)
        return torch.where(own, loc, -1), torch.where(own, coef, 0.0).float().contiguous()

    def apply(self, hidden, weight, params: LCEParams, dh, dw, columns_done: bool = False) -> None:
        """Add the sparse columns (unless the backend took them: columns_done) and the logit sum's term to
        the vocab-partial dh [N, H] and dw."""
        if not columns_done:
            sparse_grad(hidden, weight, self.ids, self.coef, params, dh, dw)
        if self.g_lsum is not None and params.shard_valid:
            # sum_logit = h · Σ_j W_j over the shard's real rows: a rank-one gradient
            acc = self.g_lsum.dtype
            wv = weight[: params.shard_valid]
            if dh is not None:
                dh += self.g_lsum[:, None] * wv.to(acc).sum(0)[None, :]
            if dw is not None:
                upd = (self.g_lsum[None, :] @ hidden.to(acc))
                dw[: params.shard_valid] = (dw[: params.shard_valid].to(acc) + upd).to(dw.dtype)
