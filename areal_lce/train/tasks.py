"""Embedded RL tasks: prompt generators with a verifiable answer, shipped in the repo (no data set).

A task is any object with `sample(n, rng: random.Random) -> list[TaskPrompt]` and a
`default_reward` dotted path (used when `rl.reward_fn` is empty). `rl.task` names one of `TASKS` or
gives a dotted path 'pkg.module:factory' to a user task; `rl.task_options` are the factory's kwargs.

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
import random
from dataclasses import dataclass
from typing import Callable, Dict, List


@dataclass(frozen=True)
class TaskPrompt:
    text: str  # the prompt as text (the job tokenizes it)
    answer: str  # what the verifier compares against


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


def load_object(spec: str, what: str):
    """Import 'pkg.module:name' (or 'pkg.module.name'); errors name the option `what`."""
    mod_name, sep, attr = spec.partition(":")
    if not sep:
        mod_name, _, attr = spec.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"{what}={spec!r}: expected a dotted path 'package.module:name'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{what}={spec!r}: cannot import module {mod_name!r} ({e})") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{what}={spec!r}: module {mod_name!r} has no attribute {attr!r}") from None


def build_task(spec: str, options: dict | None = None):
    """The task named by `rl.task` (a TASKS key or a dotted factory path), built with `rl.task_options`."""
    factory = TASKS.get(spec)
    if factory is None:
        if ":" not in spec and "." not in spec:
            raise ValueError(f"rl.task={spec!r}: expected one of {sorted(TASKS)} or a dotted path "
                             "'package.module:factory'")
        factory = load_object(spec, "rl.task")
    try:
        task = factory(**(options or {}))
    except TypeError as e:
        raise ValueError(f"rl.task_options={options!r} do not fit task {spec!r}: {e}") from e
    if not callable(getattr(task, "sample", None)):
        raise ValueError(f"rl.task={spec!r} built {type(task).__name__}, which has no sample(n, rng) method")
    return task
