"""Prompts of a prompt/response data set as an RL task, and a graded text score: what a distillation
run samples on and measures its student with (rl.task: areal_lce.train.distill_tasks:DataPrompts).

The teacher of configs/distill_tiny.yaml is the SFT job's model, trained on the embedded data
(builtin:sft_tiny.jsonl); its prompts are this task's, so the teacher answers them as it learnt to, and
`similarity` scores any answer on a 0..1 scale (a tiny teacher gets parts of its answers right long
before it gets whole ones, so an exact match would read 0 for student and teacher alike).
"""
from __future__ import annotations

import random
from typing import List

from .data import read_jsonl, resolve_data_path
from .tasks import TaskPrompt


class DataPrompts:
    """Prompts drawn uniformly from a prompt_response JSONL file (`path`: a file or 'builtin:NAME'), those
    starting with `prefix` only (empty: all); the answer is the row's response."""

    default_reward = "areal_lce.train.distill_tasks:similarity"

    def __init__(self, path: str = "builtin:sft_tiny.jsonl", prefix: str = "", prompt_key: str = "prompt",
                 response_key: str = "response"):
        where = f"rl.task_options.path={path!r}"
        rows = read_jsonl(resolve_data_path(path))
        pairs = []
        for i, row in enumerate(rows, 1):
            prompt, response = row.get(prompt_key), row.get(response_key)
            if not isinstance(prompt, str) or not isinstance(response, str):
                raise ValueError(f"{where}: row {i} lacks a string {prompt_key!r} or {response_key!r} "
                                 "(rl.task_options.prompt_key / response_key)")
            if prompt.startswith(prefix):
                pairs.append(TaskPrompt(prompt, response))
        if not pairs:
            raise ValueError(f"{where}: no row's prompt starts with rl.task_options.prefix={prefix!r}")
        self.prompts = pairs

    def sample(self, n: int, rng: random.Random) -> List[TaskPrompt]:
        return [self.prompts[rng.randrange(len(self.prompts))] for _ in range(n)]


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of characters)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def similarity(prompt: str, response: str, answer: str) -> float:
    """1 - edit distance / length of the longer of the stripped response and answer: 1 for the answer
    itself, 0 for an answer sharing no aligned character with it (or an empty one against a non-empty)."""
    r, a = response.strip(), answer.strip()
    longest = max(len(r), len(a))
    return 1.0 if longest == 0 else 1.0 - edit_distance(r, a) / longest
