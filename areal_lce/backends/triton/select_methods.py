"""The Triton backend's optional methods for selected ids and top-k (base.py). Their launchers
(select_launch.py, output_launch.py) import launch.py, which defines the backend with this mixin, hence the
imports on first use."""
from __future__ import annotations


class SelectMethods:
    """gather_logits, pair_logits, rank_segments and candidate_topk (select_launch.py), and the per-row steps
    around the outputs, each one launch: selected_raw, selected_logprobs, topk_logprobs and sparse_columns
    (output_launch.py)."""

    def gather_logits(self, hidden, weight, cols):
        from .select_launch import gather_logits
        return gather_logits(hidden, weight, cols)

    def pair_logits(self, hidden, weight, ids, need, vocab_start):
        from .select_launch import pair_logits
        return pair_logits(hidden, weight, ids, need, vocab_start)

    def rank_segments(self, seg_max, inv_t, kk, top=None, vocab_start=0, lists=False):
        from .select_launch import rank_segments
        return rank_segments(seg_max, inv_t, kk, top, vocab_start, lists)

    def candidate_topk(self, hidden, weight, row0, segs, thr, inv_t, params, vocab_start, k, plan=None):
        from .select_launch import candidate_topk
        return candidate_topk(hidden, weight, row0, segs, thr, inv_t, params, vocab_start, k, plan)

    def selected_raw(self, hidden, weight, ids, params):
        from .output_launch import selected_raw
        return selected_raw(hidden, weight, ids, params)

    def selected_logprobs(self, r, ids, labels, lse, inv_t, params):
        from .output_launch import selected_logprobs
        return selected_logprobs(r, ids, labels, lse, inv_t, params)

    def topk_logprobs(self, keys, labels, lse, params):
        from .output_launch import topk_logprobs
        return topk_logprobs(keys, labels, lse, params)

    def sparse_columns(self, labels, inv_t, params, g, g_lse, parts):
        from .output_launch import sparse_columns
        return sparse_columns(labels, inv_t, params, g, g_lse, parts)
