"""The distillation losses (areal_lce.train.distill_loss) against a float64 materialised oracle.

Oracle: full teacher and student distributions over a small vocabulary in float64, the teacher's top-k
ids, and the KL of the two distributions coarsened to those ids + one tail bucket, written from the
definition (Σ p log p/q over k + 1 cells). The loss takes fp32 logprobs at the ids, as the fused op
returns them; its value and its gradient to the student's logits must match the oracle's within fp32
rounding of the k + 1 terms (each within a few ulps of log-probabilities of magnitude <= ~30, see TOL).
"""
from __future__ import annotations

import pytest
import torch

from areal_lce.engine.config import EngineConfig
from areal_lce.train.distill_config import DistillConfig, check_rl_for_distill
from areal_lce.train.distill_loss import TAIL_FLOOR, DistillMicroBatch, distill_loss, forward_kl_topk
from areal_lce.train.rl_config import RLConfig

# fp32 log-softmax of logits up to ~30 in magnitude: absolute error a few ulp(32) = 2^-18 per logprob; the
# KL sums k + 1 <= 9 such products with probabilities <= 1 and their gradients likewise: 2^-12 is far above
# that rounding and far below any error of the formula (a wrong tail or a missing term moves it by > 1e-2).
TOL = 2.0 ** -12


def _oracle(t_logits: torch.Tensor, s_logits: torch.Tensor, k: int):
    """float64: teacher top-k ids and KL(coarsened p || coarsened q) per row."""
    p = torch.log_softmax(t_logits.double(), -1).exp()
    q = torch.log_softmax(s_logits.double(), -1).exp()
    ids = torch.topk(p, k, dim=-1).indices
    pk, qk = p.gather(-1, ids), q.gather(-1, ids)
    pc = torch.cat([pk, (1 - pk.sum(-1, keepdim=True)).clamp_min(0)], -1)
    qc = torch.cat([qk, (1 - qk.sum(-1, keepdim=True)).clamp_min(TAIL_FLOOR)], -1)
    kl = torch.where(pc > 0, pc * (pc.log() - qc.log()), torch.zeros_like(pc)).sum(-1)
    return ids, kl


# why each case: flat rows (large tails), peaked teacher rows (tail near 0: the floor and the expm1 path),
# a student equal to the teacher (KL exactly 0, no gradient), odd vocabulary
CASES = {"flat": (1.0, 0.0, False), "peaked": (12.0, 0.0, False), "student_is_teacher": (3.0, 0.0, True),
         "student_scaled": (3.0, 2.0, False)}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_kl_topk_matches_float64_oracle(case):
    scale, shift, same = CASES[case]
    g = torch.Generator().manual_seed(0)
    n, v, k = 13, 97, 8
    t_logits = torch.randn(n, v, generator=g, dtype=torch.float64) * scale
    s_logits = t_logits.clone() if same else torch.randn(n, v, generator=g, dtype=torch.float64) * 2 + shift
    ids, want = _oracle(t_logits, s_logits, k)
    s_ref = s_logits.clone().requires_grad_(True)
    _, kl_ref = _oracle(t_logits, s_ref, k)
    kl_ref.sum().backward()

    s32 = s_logits.float().requires_grad_(True)
    student = torch.log_softmax(s32, -1).gather(-1, ids)
    teacher = torch.log_softmax(t_logits.float(), -1).gather(-1, ids)
    got = forward_kl_topk(student, teacher, ids)
    got.sum().backward()
    assert got.dtype == torch.float32 and got.shape == (n,)
    err, gerr = (got.double() - want).abs().max().item(), (s32.grad.double() - s_ref.grad).abs().max().item()
    assert err < TOL and gerr < TOL, (case, err, gerr)
    if same:
        assert got.abs().max().item() < TOL and s32.grad.abs().max().item() < TOL


def test_forward_kl_topk_ignored_entries_and_rows():
    """ignore_index ids leave the support (as if k were smaller); rows of only ignored ids give 0 and no NaN
    gradient."""
    g = torch.Generator().manual_seed(1)
    t_logits, s_logits = torch.randn(4, 50, generator=g), torch.randn(4, 50, generator=g)
    ids = torch.topk(t_logits, 6, -1).indices
    s = s_logits.clone().requires_grad_(True)
    lp_s, lp_t = torch.log_softmax(s, -1), torch.log_softmax(t_logits, -1)
    full = forward_kl_topk(lp_s.gather(-1, ids[:, :4]), lp_t.gather(-1, ids[:, :4]), ids[:, :4])
    ids_ign = ids.clone()
    ids_ign[:, 4:] = -100
    ids_ign[3] = -100
    sel_s = torch.where(ids_ign != -100, lp_s.gather(-1, ids), torch.zeros(()))  # the op's 0 at ignored ids
    sel_t = torch.where(ids_ign != -100, lp_t.gather(-1, ids), torch.zeros(()))
    got = forward_kl_topk(sel_s, sel_t, ids_ign)
    torch.testing.assert_close(got[:3], full[:3], rtol=0, atol=1e-6)
    assert got[3].item() == 0.0
    got.sum().backward()
    assert torch.isfinite(s.grad).all() and s.grad[3].abs().max().item() == 0.0


class _Stats:
    def __init__(self, logprobs, entropy, selected_logprobs):
        self.logprobs, self.entropy, self.selected_logprobs = logprobs, entropy, selected_logprobs


def test_distill_loss_token_mean_and_reverse_kl_gradient():
    """The micro-batch loss: token mean over response positions of the forward KL, plus the reverse-KL
    REINFORCE term whose gradient is (log q - log p) ∇ log q (float64 check)."""
    g = torch.Generator().manual_seed(2)
    b, s, v, k = 2, 5, 40, 4
    t_logits = torch.randn(b, s, v, generator=g, dtype=torch.float64) * 3
    s_logits = torch.randn(b, s, v, generator=g, dtype=torch.float64).requires_grad_(True)
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[0, :2] = -100  # a prompt
    labels[1, 4] = -100  # padding
    ids, kl = _oracle(t_logits, s_logits, k)
    ids = torch.where((labels != -100)[..., None], ids, torch.full_like(ids, -100))
    lq = torch.log_softmax(s_logits, -1)
    lp = torch.log_softmax(t_logits, -1)
    mask = labels != -100
    lab = labels.clamp_min(0)[..., None]
    q_y, p_y = lq.gather(-1, lab)[..., 0], lp.gather(-1, lab)[..., 0]
    coef, n_minibatch = 0.5, 11
    want = ((kl + coef * (q_y - p_y).detach() * q_y) * mask).sum() / n_minibatch
    want.backward()
    want_grad = s_logits.grad.clone()

    s32 = s_logits.detach().float().requires_grad_(True)
    lq32 = torch.log_softmax(s32, -1)
    sel = torch.where(ids != -100, lq32.gather(-1, ids.clamp_min(0)), torch.zeros(()))
    t_sel = torch.where(ids != -100, lp.float().gather(-1, ids.clamp_min(0)), torch.zeros(()))
    stats = _Stats(torch.where(mask, lq32.gather(-1, lab)[..., 0], torch.zeros(())), torch.zeros(b, s), sel)
    mb = DistillMicroBatch(input_ids=torch.zeros(b, s, dtype=torch.long), labels=labels, selected_ids=ids,
                           teacher_logprobs=t_sel, teacher_token_logprobs=torch.where(mask, p_y, 0).float(),
                           num_tokens=n_minibatch)
    loss, metrics = distill_loss(stats, mb, coef)
    loss.backward()
    assert abs(loss.item() - want.item()) < TOL
    assert (s32.grad.double() - want_grad).abs().max().item() < TOL
    assert abs(metrics["kl_fwd"].item() - (kl * mask).sum().item() / mask.sum().item()) < TOL
    assert abs(metrics["reverse_kl"].item() - ((q_y - p_y) * mask).sum().item() / mask.sum().item()) < TOL


def test_distill_config_refuses_what_it_would_ignore():
    with pytest.raises(ValueError, match="distill.top_k"):
        DistillConfig(top_k=65, teacher_checkpoint="x")
    with pytest.raises(ValueError, match="rl.kl_coef"):
        check_rl_for_distill(RLConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="no weights"):
        DistillConfig().check_for_job(RLConfig(), EngineConfig())
    with pytest.raises(ValueError, match="selected_ids"):
        DistillMicroBatch(input_ids=torch.zeros(1, 2, dtype=torch.long), labels=torch.zeros(1, 2, dtype=torch.long),
                          teacher_logprobs=torch.zeros(1, 2, 3), teacher_token_logprobs=torch.zeros(1, 2))
