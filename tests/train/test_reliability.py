"""Failure behaviour: bad input, kills and stalled ranks end in a clear error or a correct result, never in a
silently wrong number, an opaque crash or a hang.

In process: second-order gradients are refused; bad op options, environment variables and YAML (duplicate
keys, syntax errors, YAML 1.2 floats) are named; bad engine/RL options fail at config load; token ids
beyond the model's vocabulary fail at data load; a torn metrics line and a corrupt checkpoint behind
COMPLETE do not stop a resume, which still reproduces the uninterrupted run bitwise; checkpoint files are
fsynced before COMPLETE.
Two gloo ranks, ONE launch of tests/train/reliability_worker.py: a TP rank whose vocab shard is all padding
(op, materialised route, SFT job), a full weight passed with tp_group, ranks with different labels, and a
stalled rank against the collective timeout.
"""
from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import types
from pathlib import Path

import pytest
import torch

from helpers.paths import REPO
from areal_lce import VocabParallel, linear_logprobs_entropy
from areal_lce.train import checkpoint as ckpt
from areal_lce.train import sft
from areal_lce.train.config import ConfigError, load_config
from areal_lce.train.logging_utils import MetricsLog, read_metrics
from areal_lce.train.tokenizer import ByteTokenizer

from helpers.launch import torchrun
from helpers.groups import fake_group  # noqa: F401  (fixture: a recording 2-rank TP group)

SFT_TINY = REPO / "configs" / "sft_tiny.yaml"
GRPO_TINY = REPO / "configs" / "grpo_tiny.yaml"


# ------------------------------------------------------------------------ second-order gradients

def _op_inputs(n_ignored: int, weight_grad: bool):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 8, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(10, 8, dtype=torch.float64, generator=g).requires_grad_(weight_grad)
    y = torch.randint(0, 10, (6,), generator=g)
    y[:n_ignored] = -100
    return h, w, y


# no ignored row (hidden saved as is) and ignored rows (hidden compacted) with a frozen weight: the
# refusal must reach d/dh in both, also when the gradient is mixed with other terms
@pytest.mark.parametrize("n_ignored,weight_grad", [(0, True), (2, False)], ids=["dense", "compacted-frozen_w"])
def test_second_order_gradient_is_refused(n_ignored, weight_grad):
    h, w, y = _op_inputs(n_ignored, weight_grad)
    first, = torch.autograd.grad(linear_logprobs_entropy(h, w, y).logprobs.sum(), h)
    out = linear_logprobs_entropy(h, w, y)
    g, = torch.autograd.grad((out.logprobs + 0.5 * out.entropy).sum() - 0.5 * out.entropy.sum(), h,
                             create_graph=True)
    assert torch.equal(g, first)  # first order is unchanged by create_graph=True
    with pytest.raises(RuntimeError, match="second-order gradients"):
        torch.autograd.grad((g ** 2).sum() + (h ** 2).sum(), h)


def test_second_order_gradient_is_refused_on_the_tensor_parallel_path(fake_group):  # noqa: F811
    """With a VocabParallel group (the same torch.library ops, the group by name, collectives inside): the
    same refusal there, dense and with ignored rows."""
    for n_ignored in (0, 2):
        h, w, y = _op_inputs(n_ignored, True)
        out = linear_logprobs_entropy(h, w, y, vocab_parallel=VocabParallel(fake_group), backend="torch")
        first, = torch.autograd.grad(out.logprobs.sum(), h, retain_graph=True)
        g, = torch.autograd.grad(out.logprobs.sum(), h, create_graph=True)
        assert torch.equal(g, first)
        with pytest.raises(RuntimeError, match="second-order gradients"):
            torch.autograd.grad((g ** 2).sum() + (h ** 2).sum(), h)


@pytest.mark.slow
def test_gradgradcheck_raises_instead_of_failing_silently():
    h, w, y = _op_inputs(1, True)
    with pytest.raises(RuntimeError, match="second-order gradients"):
        torch.autograd.gradgradcheck(lambda a, b: linear_logprobs_entropy(a, b, y).logprobs, (h, w))


# ------------------------------------------------------------------------ op options

def _call(**kw):
    g = torch.Generator().manual_seed(1)
    args = dict(hidden=torch.randn(4, 8, generator=g), weight=torch.randn(10, 8, generator=g),
                labels=torch.randint(0, 10, (4,), generator=g))
    args.update(kw)
    return linear_logprobs_entropy(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


BAD_OPTIONS = [
    pytest.param(dict(ignore_index=None), TypeError, "ignore_index", id="ignore_index=None"),
    pytest.param(dict(vocab_size=True), TypeError, "vocab_size", id="vocab_size=True"),
    pytest.param(dict(temperature="2.0"), TypeError, "temperature", id="temperature='2.0'"),
    pytest.param(dict(temperature=None), TypeError, "temperature", id="temperature=None"),
    pytest.param(dict(temperature=1e-40), ValueError, "temperature.*overflows", id="temperature=1e-40"),
    pytest.param(dict(hidden=torch.tensor(1.0)), TypeError, "hidden.*0-d", id="0-d hidden"),
    pytest.param(dict(hidden=torch.randn(4, 0), weight=torch.randn(10, 0)), ValueError, "H and weight's V",
                 id="H=0"),
    pytest.param(dict(hidden=torch.randn(4, 8, device="meta"), weight=torch.randn(10, 8, device="meta"),
                      labels=torch.zeros(4, dtype=torch.long, device="meta")), ValueError, "meta device",
                 id="meta tensors"),
    pytest.param(dict(tp_group=1), TypeError, "unexpected keyword argument 'tp_group'", id="tp_group=1"),
]


@pytest.mark.parametrize("kw,exc,match", BAD_OPTIONS)
def test_bad_op_input_names_the_option(kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(**kw)


@pytest.mark.parametrize("var,value", [("AREAL_LCE_BACKEND", "torhc"), ("AREAL_LCE_TORCH_CHUNK_BYTES", "32M"),
                                       ("AREAL_LCE_TORCH_CHUNK_BYTES", "-1")])
def test_bad_environment_variable_is_named(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"environment variable {var}={value!r}"):
        _call(backend="auto" if var == "AREAL_LCE_BACKEND" else "torch")


def test_valid_chunk_budget_still_works(monkeypatch):
    monkeypatch.setenv("AREAL_LCE_TORCH_CHUNK_BYTES", "4096")  # tiny chunks: same values as the default
    small = _call(backend="torch").logprobs
    monkeypatch.delenv("AREAL_LCE_TORCH_CHUNK_BYTES")
    torch.testing.assert_close(small, _call(backend="torch").logprobs)


# ------------------------------------------------------------------------ config

def _yaml(tmp_path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_duplicate_yaml_key_names_the_key_and_line(tmp_path):
    p = _yaml(tmp_path, "job: sft\ntrainer:\n  steps: 3\nengine:\n  seed: 1\ntrainer:\n  steps: 5\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'trainer' \(first given on line 2\)(.|\n)*line 6"):
        load_config(p)
    p = _yaml(tmp_path, "engine:\n  optim:\n    lr: 0.1\n    lr: 0.2\n")  # nested too
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        load_config(p)
    with pytest.raises(ConfigError, match="duplicate key 'n'"):  # and in a mapping given on the command line
        load_config(None, ["rl.task_options={n: 1, n: 2}"])


def test_yaml_1_2_numbers_are_accepted_for_numeric_options_only(tmp_path):
    p = _yaml(tmp_path, "engine:\n  optim:\n    lr: 1e-3\n    min_lr: 1E-5\n    betas: [0.9, 9.5e-1]\n"
                        "  lce:\n    cache_bytes: 1e6\ntrainer:\n  output_dir: 1e3\nrl:\n  clip_eps_high: 3e-1\n")
    cfg = load_config(p)
    assert cfg.engine.optim.lr == 1e-3 and cfg.engine.optim.min_lr == 1e-5
    assert cfg.engine.optim.betas == (0.9, 0.95) and cfg.rl.clip_eps_high == 0.3
    assert cfg.engine.lce.cache_bytes == 1_000_000 and isinstance(cfg.engine.lce.cache_bytes, int)
    assert cfg.trainer.output_dir == "1e3"  # a string option keeps its text
    with pytest.raises(ConfigError, match="engine.optim.lr"):
        load_config(_yaml(tmp_path, "engine:\n  optim:\n    lr: 1e-3x\n"))
    with pytest.raises(ConfigError, match="engine.lce.cache_bytes"):
        load_config(_yaml(tmp_path, "engine:\n  lce:\n    cache_bytes: 1.5e0\n"))


def test_malformed_yaml_takes_the_config_error_path(tmp_path, capsys):
    from areal_lce.train.__main__ import main

    p = _yaml(tmp_path, "job: sft\ntrainer: {steps: 3\n")
    assert main([str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error:") and "job.yaml" in err and "line 2" in err and "Traceback" not in err


@pytest.mark.parametrize("override,named", [("engine.lce.backend=torhc", "engine.lce.backend"),
                                            ("rl.temperature=inf", "rl.temperature"),
                                            ("rl.temperature=nan", "rl.temperature"),
                                            ("engine.parallel.timeout_s=0", "timeout_s")])
def test_bad_engine_and_rl_options_fail_at_config_load(override, named, monkeypatch, capsys):
    from areal_lce.train import __main__ as entry

    with pytest.raises(ConfigError, match=named):
        load_config(GRPO_TINY, [override])
    monkeypatch.setattr(entry, "run_job", lambda cfg: pytest.fail("the job started"))  # no model is built
    assert entry.main([str(GRPO_TINY), override]) == 2
    assert named in capsys.readouterr().err
    with pytest.raises(ValueError, match="rl.temperature"):  # the dataclass itself, built from Python
        from areal_lce.train.rl_config import RLConfig
        RLConfig(temperature=float("inf"))


def test_collective_timeout_option():
    from areal_lce.engine.config import ParallelConfig

    assert ParallelConfig().timeout_s == 600.0
    assert load_config(SFT_TINY, ["engine.parallel.timeout_s=30"]).engine.parallel.timeout_s == 30.0


# ------------------------------------------------------------------------ token ids beyond the vocabulary

class SmallVocabTokenizer(ByteTokenizer):
    """Bytes as ids, but a 128-id vocabulary: with a model of 128 ids (engine.model.vocab_size=128, as the tests
    below set), any non-ASCII character gives an id the model lacks."""

    name = "small-vocab"

    def __init__(self, special_ids=(125, 126, 127)):
        super().__init__()
        self.vocab_size = 128
        self.pad_id, self.bos_id, self.eos_id = special_ids


def _no_engine(*args, **kwargs):
    raise AssertionError("the engine was built: the bad token id was not caught at data load")


@pytest.fixture
def no_engine(monkeypatch):
    """Building a MegatronEngine fails the test: the jobs must catch bad data before any model exists."""
    from areal_lce.engine import engine

    monkeypatch.setattr(engine, "MegatronEngine", _no_engine)


def test_sft_token_id_beyond_vocab_fails_at_data_load(tmp_path, monkeypatch, no_engine):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "Say:", "response": "ok"}) + "\n"
                    + json.dumps({"prompt": "Sag:", "response": "schön"}) + "\n")
    monkeypatch.setattr(sft, "load_tokenizer", lambda spec: SmallVocabTokenizer())
    cfg = load_config(SFT_TINY, [f"data.path={data}", f"trainer.output_dir={tmp_path / 'run'}",
                                 "trainer.progress=false", "engine.model.vocab_size=128"])
    with pytest.raises(ValueError, match=rf"{data}:2\).*token id 195 .*vocabulary of 128 ids"):
        sft.run(cfg)


def test_rl_token_id_beyond_vocab_is_named(monkeypatch, no_engine):
    from areal_lce.train import rl

    cfg = load_config(GRPO_TINY, ["rl.task_options={template: 'Sag {x}:ü'}", "engine.model.vocab_size=128"])
    info = types.SimpleNamespace(dp_size=1, dp_rank=0, tp_size=1)
    monkeypatch.setattr(rl, "load_tokenizer", lambda spec: SmallVocabTokenizer(special_ids=(125, 126, 300)))
    with pytest.raises(ValueError, match="eos_id: token id 300 .*vocabulary of 128"):
        rl.RLJob(cfg, info)  # the host-side part of the job: no engine is built

    monkeypatch.setattr(rl, "load_tokenizer", lambda spec: SmallVocabTokenizer())
    job = rl.RLJob(cfg, info)
    with pytest.raises(ValueError, match=r"rl.task='say_letter' prompt 'Sag A:ü': token id 195 .*128"):
        job.encode_prompt("Sag A:ü")


# ------------------------------------------------------------------------ kill, damage, resume

def test_torn_metrics_line_is_skipped_and_repaired(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    with pytest.warns(RuntimeWarning, match="torn last line"):
        assert [r["step"] for r in read_metrics(path)] == [1, 2]
    with pytest.warns(RuntimeWarning, match="torn last line"):
        MetricsLog(path, resume_step=2)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'  # repaired
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')  # damage before the end is not a torn write
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(path)


def _sft_cfg(out, *overrides):
    return load_config(SFT_TINY, [f"trainer.output_dir={out}", "trainer.global_batch_size=4",
                                  "trainer.micro_batch_size=2", "trainer.progress=false", "trainer.log_interval=100",
                                  "engine.optim.warmup_steps=1", "trainer.sample_prompts=0", "trainer.plot=false",
                                  "trainer.steps=4", "trainer.save_interval=1", *overrides])


def _trace_durability(monkeypatch) -> list:
    """Record os.fsync (of which path) and os.replace calls, in order."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.realpath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to map file descriptors to paths")
def test_resume_past_a_torn_metrics_line_and_a_corrupt_checkpoint_is_exact(tmp_path, monkeypatch):
    full = {r["step"]: r["loss"] for r in sft.run(_sft_cfg(tmp_path / "full"))["records"]}

    run = tmp_path / "killed"
    with monkeypatch.context() as m:
        events = _trace_durability(m)
        sft.run(_sft_cfg(run, "trainer.stop_at=3"))  # "killed" after step 3, checkpoints 1, 2, 3 on disk
    # durable: each file fsynced under its temporary name, renamed, its directory fsynced, COMPLETE last
    step3 = os.path.realpath(ckpt.checkpoint_dir(run, 3))
    order = [e for e in events if e[1].startswith(step3)]
    complete = order.index(("replace", os.path.join(step3, ckpt.MARKER)))
    for name in ("engine/rank00000.pt", ckpt.STATE_FILE):
        final = os.path.join(step3, name)
        assert order.index(("fsync", final + ".tmp")) < order.index(("replace", final)) < complete, order
    assert ("fsync", os.path.join(step3, "engine")) in order[:complete] and ("fsync", step3) in order[complete:]

    # damage: the newest checkpoint's engine file is truncated behind its COMPLETE marker, and the
    # metrics log ends in a half-written line
    rank_file = ckpt.checkpoint_dir(run, 3) / "engine" / "rank00000.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:1000])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 1.2')
    with pytest.warns(RuntimeWarning) as warned:
        resumed = sft.run(_sft_cfg(run, "trainer.resume=true"))
    said = " | ".join(str(w.message) for w in warned)
    assert "torn last line" in said and f"checkpoint {ckpt.checkpoint_dir(run, 3)} is marked COMPLETE" in said
    # resumed from step 2: steps 3 and 4 are bitwise the uninterrupted run's
    assert {r["step"]: r["loss"] for r in resumed["records"]} == {3: full[3], 4: full[4]}
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]

    for s in (1, 2, 3, 4):  # nothing readable left: an error naming every checkpoint tried, not a fresh start
        f = ckpt.checkpoint_dir(run, s) / "engine" / "rank00000.pt"
        f.write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="no complete checkpoint .* can be loaded"):
        sft.run(_sft_cfg(run, "trainer.resume=auto"))
    assert ckpt.list_checkpoints(run)  # and the run directory was not cleared


# ------------------------------------------------------------------------ two gloo ranks, one launch

@functools.lru_cache(maxsize=None)
def worker_results() -> dict:
    tmp = tempfile.mkdtemp(prefix="areal_lce_reliability_")
    out = os.path.join(tmp, "worker.json")
    # the result file alone decides: the worker ends with os._exit over a process group left stalled
    return torchrun(Path(__file__).with_name("reliability_worker.py"), out, tmp, timeout=400, cwd=REPO,
                    env={"PYTHONWARNINGS": "ignore"}, result=out, check_returncode=False)


def _case(name: str) -> dict:
    res = worker_results()[name]
    for rank, r in res.items():
        assert "error" not in r or name == "stall", f"rank {rank}: {r['error']}"
    return res


@pytest.mark.distributed
def test_tp_rank_with_an_all_padding_shard_matches_the_reference():
    """vocab_size <= V_shard at TP=2: rank 1 owns no real token. Fused (torch, reference backends) and
    materialised routes against the unsharded fp64 reference, logprob-only and logprob+entropy losses."""
    res = _case("padding_shard")
    for rank, cases in res.items():
        assert sorted(cases) == sorted(f"{r}-{loss}" for r in ("torch", "reference", "materialised")
                                       for loss in ("lp", "lp_ent"))
        for key, r in cases.items():
            for k in ("d_logprobs", "d_entropy", "d_hidden_grad", "d_weight_grad"):
                assert r[k] <= 1e-5 * max(1.0, r["scale"]), (rank, key, k, r[k])
    assert all(r["d_weight_grad"] == 0.0 for r in res["1"].values())  # padding rows get exactly zero


@pytest.mark.distributed
def test_full_weight_with_tp_group_is_still_refused():
    for rank, r in _case("full_weight").items():
        assert "not the full weight" in r["refused"], (rank, r)
        assert r["zero_shard_error"] == "", (rank, r)  # an all-zero shard is not taken for a full weight


@pytest.mark.distributed
def test_tp_ranks_with_different_labels_get_a_clear_error_not_an_abort():
    for rank, r in _case("label_mismatch").items():
        assert "number of ignore_index labels differs across the tensor-parallel group" in r["ignore_pattern"]
        assert "min 1, max 2" in r["ignore_pattern"] and f"[rank {rank} of 2]" in r["ignore_pattern"]
        assert r["label_value"].startswith("ValueError: labels differ across the tensor-parallel group"), r
        assert r["after_ok"] == 1.0  # the group is still in step


@pytest.mark.distributed
def test_sft_at_tp2_with_an_all_padding_lm_head_shard_trains_on_both_routes():
    from areal_lce.engine.model.builder import padded_vocab_size

    assert padded_vocab_size(259, 512, 2) == 1024  # rank 1's 512 rows are ids 512..1023: padding only
    losses = _case("sft_padding")["0"]["losses"]
    assert len(losses["True"]) == 3 and all(5.0 < x < 5.7 for x in losses["True"]), losses
    # flag off: megatron-core's own loss, whose softmax also runs over the 765 padded columns (randomly
    # initialised, as in Megatron-LM): on the same first-step parameters its loss is the larger
    assert all(math.isfinite(x) for x in losses["False"]) and losses["False"][0] > losses["True"][0], losses


@pytest.mark.distributed
def test_a_stalled_rank_makes_the_other_fail_within_the_timeout():
    """engine.parallel.timeout_s=6 (tests/train/reliability_worker.py): rank 1 sleeps; rank 0's world barrier and
    the op's all-reduce over Megatron's TP group must both raise after ~6 s, naming the collective."""
    res = worker_results()["stall"]["0"]
    assert "error" not in res or isinstance(res["error"], str) and not res["error"].startswith("Traceback"), res
    for what in ("world_barrier", "op_tp_all_reduce"):
        r = res[what]
        assert r["error"].startswith("CollectiveError: ") and "failed on global rank 0" in r["error"], r
        assert "Timed out" in r["error"] and "engine.parallel.timeout_s" in r["error"], r
        assert 5.0 <= r["elapsed_s"] <= 30.0, r
    assert res["world_barrier"]["error"].startswith("CollectiveError: barrier")
    assert res["op_tp_all_reduce"]["error"].startswith("CollectiveError: all-reduce")
