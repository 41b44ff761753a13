"""What a run directory may hold and what a job does to it: checkpoints are read only when they match the
manifest their job wrote (a crafted pickle never runs, a flipped byte is refused, a model that does not
fit is named as such), a fresh start deletes nothing, one job at a time holds the directory (a kill -9
frees it), trainer.keep_last deletes only this run's checkpoints, a resume names changed options, and
metrics.jsonl is never truncated in place. One process (the loop on a model-free job, one tiny CPU engine);
the `gpu` case saves and reloads megatron's mixed-precision optimizer state.
"""
from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from areal_lce import durable
from areal_lce.train import checkpoint as ckpt
from areal_lce.train import loop
from areal_lce.train.config import ConfigError, load_config
from areal_lce.train.logging_utils import MetricsLog, read_metrics
from areal_lce.train.run_dir import LOCK_FILE, RunLock, close_run, open_run

from test_train_loop import CounterJob

ONE_RANK = types.SimpleNamespace(is_main=True)


def _cfg(out, *overrides):
    return load_config(None, [f"trainer.output_dir={out}", "trainer.progress=false", "trainer.plot=false",
                              "trainer.steps=5", "trainer.save_interval=1", *overrides])


class _Payload:
    """Unpickling it calls open(marker, 'w'): the marker file exists iff the pickle's code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _craft(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps({"model": _Payload(marker)}))


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------ the engine's files

@pytest.fixture(scope="module")
def engine_ckpt(tmp_path_factory):
    """A tiny CPU engine after one step, saved (sealed) once; each test copies the directory."""
    from areal_lce.engine import MicroBatch
    from areal_lce.engine.config import LCEConfig
    from areal_lce.engine.engine import MegatronEngine
    from helpers.engines import tiny_config

    cfg = tiny_config(model=dict(max_seq_len=32, num_layers=1), optim=dict(lr=1e-2), lce=LCEConfig())
    e = MegatronEngine(cfg, vocab_size=200)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    e.train_step([MicroBatch(ids, ids)], lambda stats, mb: (-stats.logprobs.mean(), {}))
    path = tmp_path_factory.mktemp("engine") / "engine"
    e.save(str(path))
    return e, cfg, path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name, data in _tree(src).items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_bytes(data)
    return dst


ENGINE_FILES = [durable.MANIFEST, "rank00000.pt", "sharded/.metadata", "sharded/__0_0.distcp", "sharded/metadata.json",
                "state.pt"]


def test_engine_files_load_only_when_they_match_the_manifest(engine_ckpt, tmp_path):
    e, _cfg_, saved = engine_ckpt
    marker = tmp_path / "code_ran"
    assert sorted(_tree(saved)) == ENGINE_FILES
    e.load(str(saved))  # the engine's own files: accepted

    # a crafted pickle in place of torch's checkpoint index (`.metadata`: torch's reader unpickles it with no
    # restriction), the manifest left alone: refused by the hash check before anything is unpickled
    crafted = _copy(saved, tmp_path / "crafted")
    _craft(crafted / "sharded" / ".metadata", marker)
    with pytest.raises(durable.IntegrityError, match=r"crafted/sharded/.metadata: .*(bytes|sha256)"):
        e.load(str(crafted))
    with pytest.raises(durable.IntegrityError, match=r"crafted/sharded/.metadata: .*(bytes|sha256)"):
        e.load_weights(str(crafted))
    # ... and with a manifest rewritten to match it (a manifest is no signature): the index's allowlist
    # unpickler refuses it before torch's reader opens it
    durable.write_manifest(crafted)
    with pytest.raises(pickle.UnpicklingError, match=r"\.metadata: refused: not a checkpoint index \(_?io.open is not"):
        e.load(str(crafted))
    # a crafted plain-state file under a forged manifest: torch.load(weights_only=True) refuses it
    forged = _copy(saved, tmp_path / "forged")
    _craft(forged / "state.pt", marker)
    durable.write_manifest(forged)
    with pytest.raises(pickle.UnpicklingError, match="state.pt: refused: it holds something other than tensors"):
        e.load(str(forged))
    assert not marker.exists(), "the crafted pickle's code ran"

    # one flipped byte in a tensor file: refused, naming the file
    flipped = _copy(saved, tmp_path / "flipped")
    data = bytearray((flipped / "sharded" / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x01
    (flipped / "sharded" / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(durable.IntegrityError, match=r"flipped/sharded/__0_0.distcp: sha256 differs"):
        e.load(str(flipped))

    # a file the job did not write, a missing manifest
    extra = _copy(saved, tmp_path / "extra")
    (extra / "sharded" / "__1_0.distcp").write_bytes(b"x")
    with pytest.raises(durable.IntegrityError, match=r"extra/sharded/__1_0.distcp: not listed"):
        e.load(str(extra))
    (extra / "sharded" / "__1_0.distcp").unlink()
    (extra / durable.MANIFEST).unlink()
    with pytest.raises(durable.IntegrityError, match=r"no MANIFEST.json"):
        e.load(str(extra))


def test_a_model_that_does_not_fit_is_named_not_taken_for_damage(engine_ckpt):
    from areal_lce.engine.config import LCEConfig
    from areal_lce.engine.engine import MegatronEngine
    from helpers.engines import tiny_engine
    from areal_lce.engine.state import CheckpointMismatch

    _e, cfg, saved = engine_ckpt
    other = MegatronEngine(cfg, vocab_size=300)  # padded vocabulary 384 rows instead of 256
    with pytest.raises(CheckpointMismatch, match=r"written for a vocabulary of 200 tokens, this model has 300"):
        other.load(str(saved))
    deeper = tiny_engine(200, model=dict(max_seq_len=32, num_layers=2), lce=LCEConfig(), trainable=False)
    with pytest.raises(CheckpointMismatch, match=r"'decoder.layers.[a-z_.]+' is \[1, .*\] in the checkpoint and "
                                                 r"\[2, .*\] in the model"):
        deeper.load_weights(str(saved))


def test_model_weights_alone(engine_ckpt, tmp_path):
    """load_weights (a frozen engine: a teacher, an export) reads the weights and nothing else; a directory
    without the format's state file is refused naming it."""
    from areal_lce.engine.config import EngineConfig
    from areal_lce.engine.engine import MegatronEngine
    from areal_lce.engine.state import CheckpointMismatch

    e, cfg, saved = engine_ckpt
    frozen = MegatronEngine(EngineConfig(model=cfg.model, seed=99), vocab_size=200, trainable=False)
    frozen.load_weights(str(saved))
    assert all(torch.equal(p, frozen.parameters_named()[n]) for n, p in e.parameters_named().items())
    assert frozen.step_count == 0 and e.step_count == 1

    other = MegatronEngine(EngineConfig(model=cfg.model, optim=cfg.optim, seed=99), vocab_size=200)
    other.save(str(tmp_path / "unstepped"))  # AdamW before its first step: no moments saved, none restored
    e.load(str(tmp_path / "unstepped"))
    assert e.step_count == 0 and not e.optimizer.state
    e.load(str(saved))  # the fixture's engine as it was

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    durable.torch_save({"model": e.gpt.state_dict()}, foreign / "rank00000.pt")
    durable.write_manifest(foreign)
    with pytest.raises(CheckpointMismatch, match=r"no state.pt: not an engine checkpoint of format"):
        frozen.load_weights(str(foreign))


def test_saved_state_is_checked_for_weights_only_loading():
    from areal_lce.engine.state import check_plain

    check_plain({"a": [torch.ones(2), (1, 2.0, "x", None)], "b": {0: torch.float32}})
    with pytest.raises(TypeError, match=r"state\['opt'\]\[1\] is a .*_Payload"):
        check_plain({"opt": [1, _Payload(Path("x"))]})


# ------------------------------------------------------------------------ checkpoints of a run

class EngineJob(CounterJob):
    """CounterJob around the real engine of `engine_ckpt` (its steps leave the engine as it is)."""

    def __init__(self, engine):
        super().__init__()
        self._engine = engine

    def build_engines(self):
        self.engine = self._engine

    def step(self, step):
        return {"value": float(step)}


def test_resume_refuses_a_crafted_or_damaged_checkpoint(engine_ckpt, tmp_path, caplog):
    run, marker = tmp_path / "run", tmp_path / "code_ran"
    loop.train(EngineJob(engine_ckpt[0]), _cfg(run, "trainer.steps=2", "trainer.stop_at=1"), ONE_RANK)
    step1 = ckpt.checkpoint_dir(run, 1)
    assert sorted(_tree(step1)) == sorted([ckpt.MARKER, durable.MANIFEST, ckpt.STATE_FILE,
                                           *(f"engine/{f}" for f in ENGINE_FILES)])
    _craft(step1 / "engine" / "sharded" / ".metadata", marker)
    with pytest.warns(RuntimeWarning, match=r"\.metadata"), \
            pytest.raises(ckpt.UnreadableCheckpoint, match=r"no complete checkpoint .* can be loaded: "
                                                           r"step_00000001: IntegrityError: .*\.metadata[^\n]*$"):
        loop.train(EngineJob(engine_ckpt[0]), _cfg(run, "trainer.steps=2", "trainer.resume=auto"), ONE_RANK)
    # both manifests forged to match: the index's allowlist unpickler still refuses it, a security event
    # (error level), the run stops and the checkpoint is kept aside, out of any re-save's way
    durable.write_manifest(step1 / "engine")
    durable.write_manifest(step1, only=ckpt.OWN)
    tampered = (step1 / "engine" / "sharded" / ".metadata").read_bytes()
    with caplog.at_level(logging.ERROR, logger="areal_lce.security"), \
            pytest.raises(ckpt.RefusedCheckpoint, match=r"step_00000001 holds a payload the loader refused \(a "
                                                        r"security event.*moved to .*step_00000001\.refused"):
        loop.train(EngineJob(engine_ckpt[0]), _cfg(run, "trainer.steps=2", "trainer.resume=auto"), ONE_RANK)
    [event] = [r for r in caplog.records if r.name == "areal_lce.security"]
    assert event.levelno == logging.ERROR and re.match(r"security: checkpoint .*step_00000001 holds a file the "
                                                       r"loader refused to unpickle.*refused: not a checkpoint index",
                                                       event.getMessage())
    aside = step1.with_name(step1.name + ".refused")
    assert not step1.exists() and (aside / "engine" / "sharded" / ".metadata").read_bytes() == tampered
    with pytest.raises(ckpt.RefusedCheckpoint, match="holds a payload the loader refused"):
        ckpt.load_model_weights(engine_ckpt[0], aside)
    assert not marker.exists(), "the crafted pickle's code ran"
    step1 = aside

    # the step directory's own files: a flipped byte in trainer_state.json, an extra file
    state = step1 / ckpt.STATE_FILE
    state.write_bytes(state.read_bytes().replace(b'"step": 1', b'"step": 2'))
    with pytest.raises(durable.IntegrityError, match=r"trainer_state.json: sha256 differs"):
        ckpt.load_checkpoint(engine_ckpt[0], step1)


def _point_past_the_data(step_dir: Path) -> None:
    """Damage checkpoint `step_dir` so that it matches its manifests but cannot be decoded: every entry of the
    tensors' index points past its file's data (torch's reader raises CheckpointException, a BaseException)."""
    from areal_lce.engine.sharded import read_metadata

    index = step_dir / "engine" / "sharded"
    metadata = read_metadata(str(index))
    for info in metadata.storage_data.values():
        info.offset += 1 << 30
    (index / ".metadata").write_bytes(pickle.dumps(metadata))
    durable.write_manifest(step_dir / "engine")
    durable.write_manifest(step_dir, only=ckpt.OWN)


def test_a_checkpoint_that_cannot_be_decoded_falls_back_or_ends_in_one_line(engine_ckpt, tmp_path):
    run = tmp_path / "run"
    loop.train(EngineJob(engine_ckpt[0]), _cfg(run, "trainer.steps=3", "trainer.stop_at=2"), ONE_RANK)
    _point_past_the_data(ckpt.checkpoint_dir(run, 2))
    with pytest.warns(RuntimeWarning, match=r"step_00000002 is marked COMPLETE but cannot be loaded "
                                            r"\(CheckpointException on rank 0: .*\); falling back"):
        res = loop.train(EngineJob(engine_ckpt[0]), _cfg(run, "trainer.steps=3", "trainer.resume=auto"), ONE_RANK)
    assert [r["step"] for r in res["records"]] == [2, 3]  # from step 1, the previous complete checkpoint
    for step in (1, 2, 3):
        _point_past_the_data(ckpt.checkpoint_dir(run, step))
    with pytest.warns(RuntimeWarning), pytest.raises(ckpt.UnreadableCheckpoint) as none_left:
        loop.train(EngineJob(engine_ckpt[0]), _cfg(run, "trainer.steps=3", "trainer.resume=auto"), ONE_RANK)
    assert "\n" not in str(none_left.value) and str(none_left.value).startswith(
        f"no complete checkpoint under {run / 'checkpoints'} can be loaded: step_00000003: CheckpointException")
    # the model weights alone (an export, a teacher): one line naming the checkpoint
    with pytest.raises(ckpt.UnreadableCheckpoint, match=r"^checkpoint .*step_00000001 cannot be read: "
                                                        r"CheckpointException on rank 0: [^\n]*$"):
        ckpt.load_model_weights(engine_ckpt[0], ckpt.checkpoint_dir(run, 1))
    engine_ckpt[0].load(str(engine_ckpt[2]))  # the fixture's engine as it was


def test_fresh_start_deletes_nothing_and_refuses_another_runs_files(tmp_path):
    run = tmp_path / "run"
    loop.train(CounterJob(), _cfg(run, "trainer.stop_at=2"), ONE_RANK)
    (ckpt.checkpoint_root(run) / "notes.txt").write_text("mine")
    before = _tree(run)
    with pytest.raises(ConfigError, match=rf"trainer.resume=false .* trainer.output_dir={run} holds another "
                                          r"run's files .*\(checkpoints/notes.txt, checkpoints/step_00000001.*"
                                          r"\); nothing was deleted.*trainer.resume=auto"):
        loop.train(CounterJob(), _cfg(run), ONE_RANK)
    after = _tree(run)
    assert {k: v for k, v in after.items() if k != LOCK_FILE} == {k: v for k, v in before.items() if k != LOCK_FILE}
    with RunLock(run).acquire():  # the refused run let the directory go
        pass


_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0); os.write(fd, f"pid {os.getpid()} on testhost".encode())
print("locked", flush=True)
time.sleep(120)
"""


def test_one_job_per_run_directory_and_kill_9_frees_it(tmp_path):
    run = tmp_path / "run"
    with RunLock(run).acquire() as held:
        probe = subprocess.run([sys.executable, "-c", "import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
                                "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n"
                                "    sys.exit(3)", str(run / LOCK_FILE)], timeout=30)
        assert probe.returncode == 3  # the job's lock excludes another process
        assert held.path.read_text().startswith(f"pid {os.getpid()} on ")

    # a second job (another process holds the directory): refused before it touches anything
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run / LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"trainer.output_dir={run} is in use by another job \(pid "
                                              rf"{holder.pid} on testhost holds .*run.lock\)"):
            loop.train(CounterJob(), _cfg(run), ONE_RANK)
        assert not ckpt.checkpoint_root(run).exists() and not (run / "config.yaml").exists()
        os.kill(holder.pid, signal.SIGKILL)  # kill -9: the kernel drops the lock with the process
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    res = loop.train(CounterJob(), _cfg(run, "trainer.steps=2", "trainer.resume=auto"), ONE_RANK)
    assert res["step"] == 2


def test_keep_last_deletes_only_this_runs_old_checkpoints(tmp_path):
    run = tmp_path / "run"
    loop.train(CounterJob(), _cfg(run, "trainer.keep_last=2", "trainer.stop_at=3"), ONE_RANK)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 3]
    # not this run's: a complete checkpoint without a manifest; one of ours holding a user's files beside its
    # own (an export into step_N/hf, an eval result): its own files go, the user's and their directories stay
    alien = ckpt.checkpoint_dir(run, 1)
    alien.mkdir()
    (alien / ckpt.MARKER).write_text("ok\n")
    step2 = ckpt.checkpoint_dir(run, 2)
    (step2 / "notes.txt").write_text("mine")
    (step2 / "hf").mkdir()
    (step2 / "hf" / "config.json").write_text("{}")
    with pytest.warns(RuntimeWarning, match=r"keep_last: deleted the checkpoint files of .*step_00000002; kept the "
                                            r"directory, which holds files the job did not write"):
        loop.train(CounterJob(), _cfg(run, "trainer.keep_last=2", "trainer.resume=auto"), ONE_RANK)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [1, 4, 5]  # 2 and 3 went; 1 is not provably ours
    assert _tree(step2) == {"notes.txt": b"mine", "hf/config.json": b"{}"}
    assert not ckpt.checkpoint_dir(run, 3).exists()


def test_resume_with_a_changed_config_names_the_options(tmp_path):
    run = tmp_path / "run"
    loop.train(CounterJob(), _cfg(run, "trainer.stop_at=2"), ONE_RANK)
    with pytest.raises(ConfigError, match=r"resuming .*step_00000002 with a changed model \(engine.model.num_layers: "
                                          r"0 -> 3\)"):
        loop.train(CounterJob(), _cfg(run, "trainer.resume=auto", "engine.model.num_layers=3"), ONE_RANK)
    # another parallel layout is not refused (checkpoints load at any layout): named with the others
    with pytest.warns(RuntimeWarning, match=r"changed options: engine.optim.lr: 1e-05 -> 0.002, "
                                            r"engine.optim.total_steps: 5 -> 6, engine.parallel.tensor_parallel: "
                                            r"1 -> 2, trainer.steps: 5 -> 6$"):
        res = loop.train(CounterJob(), _cfg(run, "trainer.resume=auto", "engine.optim.lr=0.002",
                                            "engine.parallel.tensor_parallel=2", "trainer.steps=6"), ONE_RANK)
    assert res["step"] == 6


def test_metrics_are_never_truncated_in_place(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    lines = "".join(f'{{"step": {s}, "loss": {s / 10}}}\n' for s in range(1, 6))
    path.write_text(lines)

    def killed(fd):  # the process dies while the kept lines are being written
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        MetricsLog(path, resume_step=2)
    assert path.read_text() == lines  # the old file is whole
    monkeypatch.undo()
    MetricsLog(path, resume_step=2)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


# ------------------------------------------------------------------------ GPU: megatron's optimizer state

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_mixed_precision_optimizer_state_round_trips_weights_only(tmp_path):
    """bf16 engine: megatron's Float16 optimizer (fp32 master weights, Adam moments) saved as sharded tensors
    and reloaded; the reloaded engine's next step equals the original's."""
    from areal_lce.engine import MicroBatch
    from areal_lce.engine.config import EngineConfig, LCEConfig
    from areal_lce.engine.engine import MegatronEngine
    from helpers.engines import tiny_config

    def loss(stats, mb):
        return -stats.logprobs.mean(), {}

    cfg = tiny_config(model=dict(dtype="bf16"), optim=dict(lr=1e-3), lce=LCEConfig())
    g = torch.Generator().manual_seed(0)
    batches = [[MicroBatch(ids, ids)] for ids in (torch.randint(0, 500, (2, 32), generator=g) for _ in range(3))]
    a = MegatronEngine(cfg, vocab_size=500)
    assert a.megatron_optimizer, "expected megatron's optimizer on CUDA"
    a.train_step(batches[0], loss)
    a.save(str(tmp_path / "engine"))
    from areal_lce.engine.sharded import read_metadata, saved_shapes

    keys = saved_shapes(read_metadata(str(tmp_path / "engine" / "sharded")))
    assert any(k.startswith("optimizer.state.fp32_param.") for k in keys), sorted(keys)
    b = MegatronEngine(EngineConfig(model=cfg.model, optim=cfg.optim, seed=99), vocab_size=500)
    b.load(str(tmp_path / "engine"))
    ra, rb = a.train_step(batches[1], loss), b.train_step(batches[1], loss)
    assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"], (ra, rb)
    for n, p in a.parameters_named().items():
        assert torch.equal(p, b.parameters_named()[n]), n
