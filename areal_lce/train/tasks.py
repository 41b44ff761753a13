"""Embedded RL tasks: prompt generators with a verifiable answer, shipped in the repo (no data set).

A task is any object with `sample(n, rng: random.Random) -> list[TaskPrompt]` and a
`default_reward` dotted path (used when `rl.reward_fn` is empty): the `Task` protocol. `rl.task` names
one of `TASKS` or gives a dotted path 'pkg.module:factory' to a user task; `rl.task_options` are the
factory's keyword arguments.

A config names code to import and call, so it must be trusted like code (docs/rl.md). What can be
checked before anything is called is: a dotted path must lead to an object written for its role -- a
task class (one with a `sample` method) or a function marked `@task_factory`; a reward function whose
signature takes `prompt`, `response` and `answer` -- defined outside Python's standard library and
built-ins, and the options must fit the factory's signature. So `rl.task: subprocess:run` with
`{args: ..., shell: true}` is refused before it is called.

say_letter  "Say A:" -> the reward is the fraction of response characters equal to the letter.
            A 2-layer randomly initialised model learns it from scratch with GRPO on a CPU in a
            few dozen steps (docs/rl.md): at init every byte is about equally likely (1/259), and each
            sampled occurrence of the target letter is rewarded, so the letter's probability climbs
            and the reward rises from ~0.004 towards 1. With several letters the model must also read
            the prompt to score above 1/len(letters).
addition    "Compute 3+4. Answer:" -> exact match of the first integer in the response with the sum;
            for pretrained checkpoints (configs/grpo_qwen2.5_0.5b.yaml).
"""
from __future__ import annotations

import importlib
import inspect
import random
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Protocol, runtime_checkable


@dataclass(frozen=True)
class TaskPrompt:
    text: str  # the prompt as text (the job tokenizes it)
    answer: str  # what the verifier compares against


@runtime_checkable
class Task(Protocol):
    """What the RL job needs of a task: prompts with answers, and the dotted path of its default reward."""

    default_reward: str

    def sample(self, n: int, rng: random.Random) -> List[TaskPrompt]:
        ...


_FACTORY_MARK = "__areal_lce_task_factory__"


def task_factory(fn: Callable) -> Callable:
    """Mark `fn` as a task factory that `rl.task` may name ('pkg.module:fn', called with rl.task_options
    as keyword arguments; it returns a Task). A task class (one with a `sample` method) needs no mark."""
    setattr(fn, _FACTORY_MARK, True)
    return fn


class SayLetter:
    """Prompt "Say X:" for X drawn from `letters`; answer X."""

    default_reward = "areal_lce.train.rewards:letter_fraction"

    def __init__(self, letters: str = "A", template: str = "Say {x}:"):
        if not letters or not all(len(c.encode("utf-8")) == 1 for c in letters):
            raise ValueError(f"rl.task_options.letters={letters!r} must be a non-empty string of ASCII characters")
        if "{x}" not in template:
            raise ValueError(f"rl.task_options.template={template!r} must contain '{{x}}'")
        self.letters, self.template = letters, template

    def sample(self, n: int, rng: random.Random) -> List[TaskPrompt]:
        out = []
        for _ in range(n):
            x = self.letters[rng.randrange(len(self.letters))]
            out.append(TaskPrompt(self.template.format(x=x), x))
        return out


class Addition:
    """Prompt "Compute a+b. Answer:" with a, b uniform in [lo, hi]; answer str(a + b)."""

    default_reward = "areal_lce.train.rewards:first_integer_match"

    def __init__(self, lo: int = 0, hi: int = 99, template: str = "Compute {a}+{b}. Answer:"):
        if not (isinstance(lo, int) and isinstance(hi, int) and lo <= hi):
            raise ValueError(f"rl.task_options lo={lo!r}, hi={hi!r}: need integers with lo <= hi")
        if "{a}" not in template or "{b}" not in template:
            raise ValueError(f"rl.task_options.template={template!r} must contain '{{a}}' and '{{b}}'")
        self.lo, self.hi, self.template = lo, hi, template

    def sample(self, n: int, rng: random.Random) -> List[TaskPrompt]:
        out = []
        for _ in range(n):
            a, b = rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)
            out.append(TaskPrompt(self.template.format(a=a, b=b), str(a + b)))
        return out


TASKS: Dict[str, Callable] = {"say_letter": SayLetter, "addition": Addition}


def _from_stdlib(module_name) -> bool:
    return isinstance(module_name, str) and module_name.split(".")[0] in sys.stdlib_module_names


def load_object(spec: str, what: str):
    """Import 'pkg.module:name' (or 'pkg.module.name'); errors name the option `what`. Refuses, before and
    after the import, an object of Python's standard library or a built-in (a C function): a config names
    code written for the job, not `subprocess:run` or `os:system`."""
    mod_name, sep, attr = spec.partition(":")
    if not sep:
        mod_name, _, attr = spec.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"{what}={spec!r}: expected a dotted path 'package.module:name'")
    if _from_stdlib(mod_name):
        raise ValueError(f"{what}={spec!r} names Python's standard library module {mod_name!r}: give a "
                         "function or class written for this purpose")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{what}={spec!r}: cannot import module {mod_name!r} ({e})") from e
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{what}={spec!r}: module {mod_name!r} has no attribute {attr!r}") from None
    if inspect.isbuiltin(obj) or _from_stdlib(getattr(obj, "__module__", None)):
        where = "a built-in" if inspect.isbuiltin(obj) else f"defined in the standard library ({obj.__module__})"
        raise ValueError(f"{what}={spec!r} is {where}, not a function or class written for this purpose")
    return obj


def _check_factory(factory, spec: str) -> None:
    """A dotted `rl.task` must name a task class (with a `sample` method) or a @task_factory function."""
    if isinstance(factory, type):
        if not callable(getattr(factory, "sample", None)):
            raise ValueError(f"rl.task={spec!r} names class {factory.__name__}, which has no sample(n, rng) method: "
                             "not a task (areal_lce.train.tasks.Task)")
    elif not (inspect.isfunction(factory) and getattr(factory, _FACTORY_MARK, False)):
        kind = "an unmarked function" if inspect.isfunction(factory) else type(factory).__name__
        raise ValueError(f"rl.task={spec!r} is {kind}: a task is a class with a sample(n, rng) method or a "
                         "function marked @areal_lce.train.tasks.task_factory (rl.task_options are passed to it, "
                         "so only code written as a task is called)")


def build_task(spec: str, options: dict | None = None) -> Task:
    """The task named by `rl.task` (a TASKS key or a dotted factory path), built with `rl.task_options`."""
    options = options or {}
    factory = TASKS.get(spec)
    if factory is None:
        if ":" not in spec and "." not in spec:
            raise ValueError(f"rl.task={spec!r}: expected one of {sorted(TASKS)} or a dotted path "
                             "'package.module:factory'")
        factory = load_object(spec, "rl.task")
        _check_factory(factory, spec)
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as e:
        raise ValueError(f"rl.task_options={options!r} do not fit task {spec!r}: {e}") from None
    task = factory(**options)
    if not isinstance(task, Task) or not isinstance(task.default_reward, str):
        raise ValueError(f"rl.task={spec!r} built {type(task).__name__}, which lacks sample(n, rng) or a "
                         "default_reward dotted path (areal_lce.train.tasks.Task)")
    return task
