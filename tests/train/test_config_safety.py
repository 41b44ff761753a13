"""A config is code, and is treated so: YAML alias bombs and recursive aliases are refused at load (anchors
and merge keys still work), one type rule for YAML values and command-line overrides, dotted `rl.task` /
`rl.reward_fn` paths checked before anything is called with the config's options, one-line errors from
the entry point, and one config on every rank."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from areal_lce.train import __main__ as entry
from areal_lce.train import rewards, tasks
from areal_lce.train.config import ConfigError, dump_yaml, load_config
from areal_lce.train.ranks import differing_options

from helpers.launch import torchrun
from helpers.paths import REPO

SFT_TINY = REPO / "configs" / "sft_tiny.yaml"
GRPO_TINY = REPO / "configs" / "grpo_tiny.yaml"


def _yaml(tmp_path, text: str, name: str = "job.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


# ------------------------------------------------------------------------ YAML: aliases, anchors, merge keys

# 444 bytes: nine levels of nine aliases each, 9**9 (387 million) strings once expanded. Loading it
# built shared references quickly; writing config.yaml then expanded it (188 s and 4.2 GB for this size).
BOMB = "job: grpo\nrl:\n  task_options:\n    a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"    {b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))


def test_alias_bomb_and_recursive_alias_are_refused_at_load(tmp_path):
    assert len(BOMB) < 500
    with pytest.raises(ConfigError, match=r"job\.yaml' is refused: .* more than the 100000 .*alias(.|\n)*line \d+"):
        load_config(_yaml(tmp_path, BOMB))
    flow = "{a: &a [x, x, x, x, x, x, x, x, x], " + ", ".join(
        f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")) + "}"
    with pytest.raises(ConfigError, match=r"rl\.task_options.*more than the 100000"):  # the same on the command line
        load_config(None, ["job=grpo", f"rl.task_options={flow}"])
    with pytest.raises(ConfigError, match="recursive"):  # a config holding itself: no dump would end
        load_config(_yaml(tmp_path, "rl:\n  task_options: &r {again: *r}\n"))


def test_anchors_and_merge_keys_still_work(tmp_path):
    cfg = load_config(_yaml(tmp_path, """\
job: grpo
data: &seq {max_seq_len: 64}
engine:
  model: {<<: *seq, num_layers: 1}
rl:
  task_options:
    base: &letters {letters: AB, template: "Say {x}:"}
    derived: {<<: *letters, letters: C}
    again: *letters
"""))
    assert cfg.engine.model.max_seq_len == 64 and cfg.engine.model.num_layers == 1  # merged from data
    opts = cfg.rl.task_options
    assert opts["derived"] == {"letters": "C", "template": "Say {x}:"} and opts["again"] == opts["base"]
    again = load_config(_yaml(tmp_path, dump_yaml(cfg), "dumped.yaml"))  # the dump round-trips
    assert again.rl.task_options == opts and again.engine.model == cfg.engine.model


# ------------------------------------------------------------------------ one rule for YAML and overrides

def _as_yaml(dotted: str, text: str) -> str:
    *sections, leaf = dotted.split(".")
    lines = [f"{'  ' * i}{s}:" for i, s in enumerate(sections)]
    return "\n".join(lines + [f"{'  ' * len(sections)}{leaf}: {text}"]) + "\n"


# Each value is refused for its option both as a YAML value and as a command-line override (the command
# line used to read 0/1/yes/on as booleans and 6.0 as an int, where YAML refused them or read them otherwise).
REFUSED = [
    ("engine.use_fused_linear_ce", "0"), ("engine.use_fused_linear_ce", "1"),   # ints are not booleans
    ("engine.use_fused_linear_ce", "yes"), ("trainer.plot", "off"),             # YAML 1.1 words are strings
    ("trainer.resume", "yes"),                                                   # bool | 'auto': not 'yes'
    ("trainer.steps", "6.0"), ("trainer.steps", "6.5"),                         # a float is not an int
    ("engine.model.tie_word_embeddings", "1"),
]
ACCEPTED = [
    ("engine.use_fused_linear_ce", "false", False), ("engine.use_fused_linear_ce", "True", True),
    ("trainer.steps", "6", 6), ("trainer.steps", "1e2", 100),                    # YAML 1.2 integral exponent
    ("engine.optim.lr", "6", 6.0), ("engine.optim.lr", "1e-3", 1e-3),
    ("trainer.resume", "auto", "auto"), ("trainer.resume", "true", True),
    ("engine.model.tie_word_embeddings", "null", None), ("engine.model.tie_word_embeddings", "none", None),
    ("trainer.output_dir", "runs/yes", "runs/yes"),
]


@pytest.mark.parametrize("option,text", REFUSED, ids=[f"{o}={t}" for o, t in REFUSED])
def test_values_refused_in_yaml_are_refused_on_the_command_line(tmp_path, option, text):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        load_config(None, [f"{option}={text}"])
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        load_config(_yaml(tmp_path, _as_yaml(option, text)))


@pytest.mark.parametrize("option,text,value", ACCEPTED, ids=[f"{o}={t}" for o, t, _ in ACCEPTED])
def test_values_accepted_in_yaml_mean_the_same_on_the_command_line(tmp_path, option, text, value):
    from_cli = _get(load_config(None, [f"{option}={text}"]), option)
    from_yaml = _get(load_config(_yaml(tmp_path, _as_yaml(option, text))), option)
    assert from_cli == from_yaml == value and type(from_cli) is type(from_yaml) is type(value)


# ------------------------------------------------------------------------ dotted code paths

USER_MODULE = '''
import random
from subprocess import run                      # a standard-library function, re-exported
from areal_lce.train.tasks import TaskPrompt, task_factory

CALLS = []

def unmarked(**options):
    CALLS.append(options)

class NotATask:
    def __init__(self, **options):
        CALLS.append(options)

class Echo:
    default_reward = "areal_lce.train.rewards:exact_match"
    def __init__(self, word="hi"):
        CALLS.append(word)
        self.word = word
    def sample(self, n, rng):
        return [TaskPrompt(self.word, self.word)] * n

@task_factory
def make_echo(word="hi"):
    return Echo(word)

def reward(prompt, response, answer):
    return 1.0

def reward_of_text(text):
    return 0.0
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "safety_user_tasks.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "safety_user_tasks", raising=False)
    import safety_user_tasks

    return safety_user_tasks


def test_task_paths_that_are_not_tasks_are_refused_before_any_call(tmp_path, user_module):
    marker = tmp_path / "ran"
    shell = {"args": f"touch {marker}", "shell": True}
    for spec, why in [("subprocess:run", "standard library module 'subprocess'"),
                      ("os:system", "standard library"),
                      ("safety_user_tasks:run", r"defined in the standard library \(subprocess\)"),
                      ("safety_user_tasks:unmarked", "an unmarked function"),
                      ("safety_user_tasks:NotATask", "no sample")]:
        with pytest.raises(ValueError, match=rf"rl\.task='{spec}'.*{why}"):
            tasks.build_task(spec, shell)
    assert not marker.exists() and user_module.CALLS == []  # nothing was called with the options
    with pytest.raises(ValueError, match=r"rl\.task_options=.*do not fit"):  # options checked before the call
        tasks.build_task("safety_user_tasks:Echo", {"colour": "red"})
    assert user_module.CALLS == []
    for spec in ("safety_user_tasks:Echo", "safety_user_tasks:make_echo"):  # a task class, a marked factory
        task = tasks.build_task(spec, {"word": "yo"})
        assert isinstance(task, tasks.Task) and task.sample(2, None)[0].answer == "yo"


def test_reward_paths_are_checked_before_the_first_call(user_module):
    for spec, why in [("os:system", "standard library"), ("builtins:eval", "standard library"),
                      ("safety_user_tasks:run", "standard library"),
                      ("safety_user_tasks:reward_of_text", r"cannot be called as fn\(prompt=str, response=str")]:
        with pytest.raises(ValueError, match=rf"rl\.reward_fn='{spec}'.*{why}"):
            rewards.load_reward(spec)
    assert rewards.load_reward("safety_user_tasks:reward") is user_module.reward


# ------------------------------------------------------------------------ errors after start-up: one line

@pytest.fixture
def quiet_entry(monkeypatch):
    monkeypatch.setattr(entry, "limit_cpu_threads", lambda: None)  # keep this process's torch threads
    # a plain single process: init_process_group sets these for its one-rank group; all are restored after
    for var in (entry.DEBUG_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "")  # recorded, so that the end of the test restores the variable
        monkeypatch.delenv(var)
    return entry


@pytest.mark.parametrize("config,override,rc,line", [
    (SFT_TINY, "data.path=/no/such/file.jsonl", 1, "error: data.path='/no/such/file.jsonl': file not found"),
    (GRPO_TINY, "rl.reward_fn=no_such_module_xyz:f", 1, "error: rl.reward_fn='no_such_module_xyz:f': cannot import"),
    (SFT_TINY, "engine.parallel.tensor_parallel=2", 1,
     "error: world size 1 is not divisible by parallel.tensor_parallel=2"),
    pytest.param(SFT_TINY, "engine.lce.backend=triton", 2,
                 "config error: engine.lce.backend='triton' cannot run on this machine",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
], ids=["missing-data-file", "unimportable-reward", "tp-over-world", "triton-without-cuda"])
def test_errors_after_start_up_print_one_line(tmp_path, quiet_entry, monkeypatch, capsys, config, override, rc,
                                              line):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the tests' default (conftest) runs Triton on the CPU
    argv = [str(config), override, f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false",
            "trainer.steps=6"]
    assert entry.main(argv) == rc
    err = capsys.readouterr().err
    assert [x for x in err.splitlines() if "error:" in x] == [x for x in err.splitlines() if x.startswith(line)]
    assert line in err and "--debug" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before the run directory was touched


def test_debug_flag_and_environment_variable_give_the_traceback(tmp_path, quiet_entry, monkeypatch):
    argv = [str(SFT_TINY), "data.path=/no/such/file.jsonl", f"trainer.output_dir={tmp_path}"]
    with pytest.raises(FileNotFoundError, match="data.path"):
        entry.main(argv + ["--debug"])
    monkeypatch.setenv(entry.DEBUG_ENV, "1")
    with pytest.raises(FileNotFoundError, match="data.path"):
        entry.main(argv)


# ------------------------------------------------------------------------ one config on every rank

def test_differing_options_groups_the_ranks():
    table = torch.tensor([[1, 2, 3], [1, 5, 3], [1, 5, 4]])  # 3 ranks x options a, b, c
    assert differing_options(table, ["a", "b", "c"]) == {"b": [[0], [1, 2]], "c": [[0, 1], [2]]}


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_with_different_configs_stop_naming_the_option(tmp_path):
    out = tmp_path / "res"
    proc = torchrun(Path(__file__).with_name("ranks_worker.py"), "config", out, SFT_TINY,
                    f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=2", "engine.optim.warmup_steps=1",
                    "trainer.progress=false", "trainer.sample_prompts=0", timeout=180, cwd=REPO,
                    env={"PYTHONWARNINGS": "ignore"}, check_returncode=False)
    rcs = {json.loads(p.read_text())["rank"]: json.loads(p.read_text())["rc"] for p in out.glob("rank*.json")}
    assert rcs == {0: 2, 1: 2}, proc.stderr[-3000:]
    for rank in (0, 1):  # every rank names the option, both sides, and its own value
        assert (f"[rank {rank}] config error: the 2 ranks run different configs: engine.optim.lr (ranks 0 | 1; "
                f"rank {rank} has 0.00{rank + 1}). Launch every rank with the same CONFIG.yaml") in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before the job touched its run directory
