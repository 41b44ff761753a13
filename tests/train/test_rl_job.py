"""The GRPO/PPO job on the real Megatron engine (CPU, tiny model, byte tokenizer).

- fused vs materialised LM-head route: same RL loss, metrics and gradients on a fixed rollout batch,
  for every loss aggregation (TP=1 here, TP=2 in the torchrun launch below);
- the embedded say_letter task: the reward after 40 GRPO steps is far above its start (seeded);
- resume from a mid-run checkpoint reproduces the uninterrupted run's later steps;
- one torchrun launch at tensor_parallel=2: route parity plus a 3-step run of the job via the CLI.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch


import rl_worker  # noqa: E402

from helpers.paths import REPO
from areal_lce.megatron import capture  # noqa: E402
from areal_lce.train import rl  # noqa: E402
from areal_lce.train.config import load_config  # noqa: E402
from areal_lce.train.logging_utils import read_metrics  # noqa: E402

GRPO_TINY = REPO / "configs" / "grpo_tiny.yaml"
REQUIRED = ("step", "reward", "entropy", "kl", "clip_frac", "max_logit", "min_logit", "grad_norm", "lr")


def _cfg(out, *overrides, path=GRPO_TINY):
    return load_config(path, [f"trainer.output_dir={out}", "trainer.progress=false", "trainer.log_interval=100",
                              *overrides])


def test_fused_and_materialised_routes_agree_on_rl_loss_and_grads(monkeypatch):
    calls = {"n": 0}
    real = capture.run_fused

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(capture, "run_fused", counting)
    report = rl_worker.route_parity(tp=1)
    assert calls["n"] > 0  # the fused engine did go through the capture seam
    for agg, r in report.items():
        assert r["loss_rel"] < 1e-5 and r["grad_rel"] < 1e-5, (agg, r)
    # the three aggregations are different numbers on this batch (so each was really exercised)
    losses = [r["loss"] for r in report.values()]
    assert len({round(x, 6) for x in losses}) == 3, losses


# Zero-mismatch RL: the sampler's logprobs (sampling.token_logprobs, what generate returns) and the
# trainer's (the op on a packed micro-batch) come from the same hidden states in different row counts
# and positions, among ignored rows. With invariant=True the head promises the same bits, so the
# mismatch metrics read exactly 0.
@pytest.mark.parametrize("logits_precision", ["fp32", "bf16"])
def test_rollout_mismatch_is_zero_with_the_invariant_head(logits_precision):
    import areal_lce
    from areal_lce.engine.generation.sampling import token_logprobs
    from areal_lce.train.rl_losses import rollout_mismatch

    g = torch.Generator().manual_seed(0)
    n, h, v, vocab = 37, 64, 1024, 1000  # a padded vocabulary, as megatron's
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * 0.3).bfloat16()
    weight[:8] = hidden[:8] * 0.5  # peaked rows: a few tokens dominate
    rows = torch.tensor([4, 5, 6, 20, 31])  # the sampler's decode batch: 5 rows of the trainer's 37
    tokens = torch.randint(0, vocab, (rows.numel(),), generator=g)
    options = dict(temperature=0.7, vocab_size=vocab, backend="torch", invariant=True,
                   logits_precision=logits_precision)
    sampled = token_logprobs(hidden[rows], weight, tokens, **options)
    labels = torch.full((n,), -100)
    labels[rows] = tokens
    trained = areal_lce.linear_logprobs_entropy(hidden, weight, labels, **options).logprobs
    rollout = torch.zeros(n)
    rollout[rows] = sampled
    m = rollout_mismatch(trained[None], rollout[None], (labels != -100)[None])
    assert m["tokens"] == rows.numel()
    assert m["abs_diff_max"] == 0 and m["abs_diff_sum"] == 0 and m["ratio_dev_max"] == 0, m


def test_rollout_logprob_rows_follow_the_labels():
    prompts, responses = [[1, 2, 3], [4], [5, 6]], [[7, 8], [9, 10, 11], []]
    logprobs = [[-0.5, -1.5], [-2.0, -2.5, -3.0], []]
    batch = rl.rollout_batch(prompts, responses, pad_id=0, pad_to_multiple_of=4)
    rows = rl.rollout_logprob_rows(batch, prompts, logprobs)
    assert rows.shape == batch.labels.shape
    for i, (r, lp) in enumerate(zip(responses, logprobs)):
        at = (batch.labels[i] != -100).nonzero().squeeze(1)
        assert batch.labels[i, at].tolist() == r and rows[i, at].tolist() == lp
        assert (rows[i].abs().sum() == sum(abs(x) for x in lp))


@pytest.mark.slow
def test_grpo_logs_the_train_rollout_mismatch(tmp_path):
    out = tmp_path / "mismatch"
    small = ("rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=4", "trainer.micro_batch_size=2")
    records = rl.run(_cfg(out, "trainer.steps=2", "trainer.save_interval=0", "trainer.save_final=false",
                          *small))["records"]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        dmax, dmean = r["train_rollout_logprob_abs_diff_max"], r["train_rollout_logprob_abs_diff_mean"]
        ratio = r["importance_ratio_abs_dev_max"]
        assert all(math.isfinite(x) and x >= 0 for x in (dmax, dmean, ratio)), r
        # fp32 on CPU: the KV-cache rollout and the update's recompute differ by rounding only (a token
        # scored at the wrong position, or at another temperature, is off by O(1))
        assert dmean <= dmax < 1e-3 and ratio < 1e-3, r
    assert "train_rollout_logprob_abs_diff_max" in read_metrics(out / "metrics.jsonl")[0]


# 40 GRPO steps of configs/grpo_tiny.yaml ("Say A:" / "Say B:"). Recorded run (docs/rl.md): mean reward
# of steps 1-3 is 0.006, of steps 38-40 0.98. Always saying one letter earns at most 0.5, so passing
# 0.75 also shows the policy reads the prompt's letter.
STEPS, SAVE_AT = 40, 36
COMMON = (f"trainer.steps={STEPS}", f"trainer.save_interval={SAVE_AT}", "trainer.save_final=false")


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    return out, rl.run(_cfg(out, *COMMON))


@pytest.mark.slow
def test_reward_rises_on_the_embedded_task(grpo_run):
    out, result = grpo_run
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, f"metrics.jsonl lacks {missing}"
        assert all(math.isfinite(r[k]) for k in REQUIRED)
    start = sum(r["reward"] for r in rows[:3]) / 3
    end = sum(r["reward"] for r in rows[-3:]) / 3
    print(f"reward first 3 steps {start:.4f}, last 3 steps {end:.4f}")
    assert start < 0.05  # a random-init model says the letter ~1/259 of the time
    assert end > 0.75, [round(r["reward"], 4) for r in rows]
    assert rows[-1]["entropy"] < rows[0]["entropy"] - 0.3  # the policy sharpens
    assert rows[0]["kl"] < rows[-1]["kl"]  # ... and moves away from the frozen reference
    assert (out / "metrics.png").is_file() and (out / "config.yaml").is_file()


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(grpo_run):
    out, result = grpo_run
    full = {r["step"]: r for r in result["records"]}
    resumed = rl.run(_cfg(out, *COMMON, "trainer.resume=true"))
    assert [r["step"] for r in resumed["records"]] == list(range(SAVE_AT + 1, STEPS + 1))
    for r in resumed["records"]:
        ref = full[r["step"]]
        assert r["sample"] == ref["sample"]  # same prompts and sampled tokens
        for k in ("reward", "loss", "kl", "entropy", "grad_norm"):
            assert r[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), (r["step"], k, r[k], ref[k])
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no duplicated steps after resume


@pytest.mark.slow
def test_packed_and_padded_rl_runs_agree(tmp_path):
    """GRPO with engine.pack_sequences true (the default) and false: same rollouts, same metrics."""
    rows = {}
    for pack in ("true", "false"):
        out = tmp_path / pack
        rl.run(_cfg(out, "trainer.steps=2", f"engine.pack_sequences={pack}"))
        rows[pack] = read_metrics(out / "metrics.jsonl")
    for a, b in zip(rows["true"], rows["false"]):
        for k in ("reward", "entropy", "kl", "max_logit", "min_logit", "grad_norm"):
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-6), (k, a[k], b[k])


def test_token_budget_ranges_hand_checked():
    from areal_lce.engine.microbatch import token_budget_ranges

    labels = torch.full((5, 6), -100)
    for r, last in enumerate([2, 5, -1, 0, 3]):  # row 2 has no target (costs nothing packed)
        if last >= 0:
            labels[r, last] = 1
    # packed costs (last target + 1): 3, 6, 0, 1, 4
    assert token_budget_ranges(labels, 9, packed=True) == [slice(0, 3), slice(3, 5)]
    assert token_budget_ranges(labels, 5, packed=True) == [slice(0, 1), slice(1, 2), slice(2, 5)]
    assert token_budget_ranges(labels, 1, packed=True) == [slice(0, 1), slice(1, 2), slice(2, 4), slice(4, 5)]
    assert token_budget_ranges(labels, 100, packed=True) == [slice(0, 5)]
    # padded costs: 6 per row
    assert token_budget_ranges(labels, 12, packed=False) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert token_budget_ranges(labels, 5, packed=False) == [slice(i, i + 1) for i in range(5)]
    assert token_budget_ranges(labels[:0], 8, packed=True) == []
    with pytest.raises(ValueError, match="max_tokens"):
        token_budget_ranges(labels, 0, packed=True)


@pytest.mark.slow
def test_logprob_passes_by_token_budget_match_per_sequence():
    """The behaviour/reference pass gives the same statistics whatever rows share a forward."""
    from areal_lce.engine.config import LCEConfig
    from areal_lce.engine.microbatch import token_budget_ranges
    from helpers.engines import tiny_engine

    vocab = 259
    batch, _ = rl_worker.fixed_rollout(vocab, seed=3, batch=9)
    batch = dataclasses.replace(batch, temperature=0.8)
    for pack in (True, False):
        eng = tiny_engine(vocab, model=dict(max_seq_len=32), lce=LCEConfig(), pack_sequences=pack, seed=5)
        one_each = rl.batched_token_stats(eng, batch, [slice(i, i + 1) for i in range(batch.rows)])
        budget = token_budget_ranges(batch.labels, 20 if pack else 2 * batch.labels.shape[1], packed=pack)
        assert 2 < len(budget) < batch.rows
        for ranges in (budget, [slice(0, batch.rows)]):
            got = rl.batched_token_stats(eng, batch, ranges)
            for name, ref in one_each.items():
                assert got[name].device.type == "cpu" and got[name].shape == batch.labels.shape
                torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-5, msg=name)
        mask = batch.labels != -100
        assert bool((one_each["logprobs"][mask] < 0).all()) and bool((one_each["logprobs"][~mask] == 0).all())
    assert rl.logprob_ranges(batch, None, 4, True) == [slice(0, 4), slice(4, 8), slice(8, 12)]


def test_logprob_max_tokens_option():
    from areal_lce.train.config import ConfigError
    from areal_lce.train.rl_config import AUTO_LOGPROB_TOKENS, RLConfig

    assert RLConfig().logprob_budget(fused=True) == AUTO_LOGPROB_TOKENS
    assert RLConfig().logprob_budget(fused=False) is None  # trainer.micro_batch_size sequences
    assert RLConfig(logprob_max_tokens=512).logprob_budget(fused=False) == 512
    for bad in ("0", "-3", "many"):
        with pytest.raises(ConfigError, match="rl.logprob_max_tokens"):
            load_config(GRPO_TINY, [f"rl.logprob_max_tokens={bad}"])


def test_bad_rl_options_name_the_option(tmp_path):
    from areal_lce.train.config import ConfigError

    with pytest.raises(ConfigError, match="rl.loss_agg"):
        _cfg(tmp_path, "rl.loss_agg=mean")
    with pytest.raises(ValueError, match="rl.reward_fn"):
        rl.run(_cfg(tmp_path, "rl.reward_fn=areal_lce.train.rewards:no_such_reward", "trainer.steps=1"))
    with pytest.raises(ValueError, match="trainer.micro_batch_size"):
        rl.run(_cfg(tmp_path, "trainer.micro_batch_size=24", "trainer.global_batch_size=24", "trainer.steps=1"))


def test_shipped_rl_configs_load():
    for name in ("grpo_tiny.yaml", "ppo_tiny.yaml", "grpo_qwen2.5_0.5b.yaml"):
        cfg = load_config(REPO / "configs" / name)
        assert cfg.job in ("grpo", "ppo"), name


@pytest.mark.distributed
def test_torchrun_tp2_route_parity_and_job(tmp_path):
    out = tmp_path / "tp2"
    from helpers.launch import torchrun

    proc = torchrun(Path(__file__).with_name("rl_worker.py"), out, timeout=120, cwd=REPO, env={"PYTHONWARNINGS": "ignore"})
    assert "RL_WORKER_OK" in proc.stdout
    assert proc.stdout.count("route parity tp=2") == 2  # both ranks checked their shards
    assert "TP 2 x PP 1 x CP 1 x DP 1" in proc.stdout and "fused linear op" in proc.stdout
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["reward"]) and math.isfinite(r["kl"]) for r in rows)
    assert len(list((out / "checkpoints" / "step_00000003" / "engine").glob("rank*.pt"))) == 2


@pytest.mark.distributed
def test_torchrun_context_parallel_matches_single_process(tmp_path):
    """GRPO at engine.parallel.context_parallel=2 (rollouts recomputed over the CP-split prefixes, logprob
    passes and the update on zigzag halves): the same metrics as the single-process run."""
    common = ["trainer.steps=2", "trainer.progress=false", "trainer.log_interval=100", "trainer.save_interval=0",
              "trainer.save_final=false"]
    out = tmp_path / "cp2"
    from helpers.launch import torchrun

    proc = torchrun("areal_lce.train", GRPO_TINY, "engine.parallel.context_parallel=2", f"trainer.output_dir={out}",
                    *common, module=True, timeout=240, cwd=REPO, env={"PYTHONWARNINGS": "ignore"})
    assert "TP 1 x PP 1 x CP 2 x DP 1" in proc.stdout and "rollout: full recompute" in proc.stdout  # CP recomputes
    single = rl.run(_cfg(tmp_path / "cp1", *common))
    rows, ref = read_metrics(out / "metrics.jsonl"), single["records"]
    assert [r["step"] for r in rows] == [1, 2]
    for a, b in zip(rows, ref):
        for k in ("reward", "entropy", "kl", "max_logit", "min_logit"):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (k, a[k], b[k])


def test_rewards_and_tasks_hand_checked():
    import random

    from areal_lce.train import rewards, tasks

    assert rewards.letter_fraction("Say A:", "AAxA", "A") == 0.75
    assert rewards.letter_fraction("Say A:", "", "A") == 0.0
    assert rewards.exact_match("", " 42 ", "42") == 1.0 and rewards.exact_match("", "420", "42") == 0.0
    assert rewards.first_integer_match("", " 95, since", "95") == 1.0
    assert rewards.first_integer_match("", "9 5", "95") == 0.0
    assert rewards.load_reward("areal_lce.train.rewards:exact_match") is rewards.exact_match
    with pytest.raises(ValueError, match="rl.reward_fn"):
        rewards.load_reward("no_such_module_xyz:f")
    # seeded sampling: the same (seed, n) gives the same prompts; answers match the prompt text
    a = tasks.build_task("say_letter", {"letters": "AB"}).sample(6, random.Random(3))
    assert a == tasks.build_task("say_letter", {"letters": "AB"}).sample(6, random.Random(3))
    assert all(p.text == f"Say {p.answer}:" for p in a) and {p.answer for p in a} <= {"A", "B"}
    for p in tasks.build_task("addition", {"lo": 1, "hi": 9}).sample(5, random.Random(0)):
        x, y = p.text.removeprefix("Compute ").split(".")[0].split("+")
        assert int(p.answer) == int(x) + int(y)
    with pytest.raises(ValueError, match="rl.task"):
        tasks.build_task("no_such_task")
    with pytest.raises(ValueError, match="rl.task_options"):
        tasks.build_task("say_letter", {"colour": "red"})
