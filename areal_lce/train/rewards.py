"""Reward functions of the RL jobs, selected by dotted path in YAML (`rl.reward_fn`).

Contract: `fn(prompt: str, response: str, answer: str) -> float`, called once per sampled response
with the decoded response text (special tokens removed, generation stopped at EOS). Any importable
function with that signature works: `rl.reward_fn: mypkg.rewards:my_reward`. Before the first call the
function is checked: defined outside the standard library and built-ins, and its signature takes the
three keyword arguments (tasks.load_object, load_reward).
"""
from __future__ import annotations

import inspect
import re
from typing import Callable

from .tasks import load_object

RewardFn = Callable[..., float]
_INT = re.compile(r"-?\d+")


def letter_fraction(prompt: str, response: str, answer: str) -> float:
    """Fraction of response characters equal to `answer` (a single character); 0 for an empty response."""
    if not response:
        return 0.0
    return sum(ch == answer for ch in response) / len(response)


def exact_match(prompt: str, response: str, answer: str) -> float:
    """1 if the stripped response equals the stripped answer, else 0."""
    return float(response.strip() == answer.strip())


def first_integer_match(prompt: str, response: str, answer: str) -> float:
    """1 if the first integer in the response equals the answer, else 0."""
    m = _INT.search(response)
    return float(m is not None and m.group(0) == answer.strip())


def load_reward(spec: str) -> RewardFn:
    """Resolve `rl.reward_fn` ('package.module:function') to a callable."""
    fn = load_object(spec, "rl.reward_fn")
    if not callable(fn):
        raise ValueError(f"rl.reward_fn={spec!r} is not callable")
    try:
        inspect.signature(fn).bind(prompt="", response="", answer="")
    except (TypeError, ValueError) as e:  # ValueError: no signature to inspect
        raise ValueError(f"rl.reward_fn={spec!r} cannot be called as fn(prompt=str, response=str, answer=str): "
                         f"{e}") from None
    return fn
