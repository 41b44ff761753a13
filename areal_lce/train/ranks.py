"""What the ranks of a train job agree on: that they run one config, and when to stop on a signal.

    check_same_config(cfg)        # once, right after the process group exists, before any model
    with StopOnSignal() as stop:  # SIGINT / SIGTERM set a flag; nothing else happens in the handler
        for step in ...:
            ...
            signum = stop.agreed()   # at the step boundary: one all-reduce MAX of one int64
            if signum: save, then raise Interrupted(signum, step)

One config: every rank hashes each option of its resolved config; one all-reduce MAX of [h, -h] over the
world compares the whole-config hashes. Only when they differ, one all-reduce SUM of a [world, options]
table (each rank fills its row) tells every rank which options differ on which ranks, and every rank
raises the same ConfigError naming them.

Signals: a checkpoint cannot be written inside a handler (the ranks may sit in different collectives),
so the handler only records the signal; the loop asks the ranks at the next step boundary whether any
rank got one (MAX over the ranks), and all of them save and stop together. A second signal while the
first waits for the step to end stops at once (Interrupted without a checkpoint).
"""
from __future__ import annotations

import hashlib
import json
import signal
import threading
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..op import comms
from .config_io import ConfigError, iter_fields

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_SHOWN_KEYS = 8  # differing options named in the error (the count says how many more)


class Interrupted(KeyboardInterrupt):
    """The job stopped on signal `signum` after step `step` (None: before a step boundary was reached,
    nothing saved). The process should exit with `exit_code`, 128 + signum (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, signum: int, step: Optional[int]):
        self.signum, self.step = int(signum), step
        self.exit_code = 128 + self.signum
        where = f"after step {step}" if step is not None else "before the step ended (no checkpoint written)"
        super().__init__(f"stopped by {signal.Signals(self.signum).name} {where}")


def _world_group():
    """The world group when the job has several ranks, else None (no collective needed)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


# ------------------------------------------------------------------------------------------ one config

def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1  # >= 0, so -h fits int64


def option_values(cfg) -> Dict[str, str]:
    """Every leaf option of dataclass config `cfg` (dotted name -> canonical JSON of its value)."""
    out = {}
    for name, *_ in iter_fields(type(cfg)):
        value = cfg
        for part in name.split("."):
            value = getattr(value, part)
        out[name] = json.dumps(value, sort_keys=True, default=repr)
    return out


def differing_options(table: torch.Tensor, names) -> Dict[str, list]:
    """From a [world, options] table of per-rank option hashes: option name -> the groups of ranks that
    agree on it (lists of ranks, in order of their first rank), for the options the ranks do not share."""
    out = {}
    for j, name in enumerate(names):
        column = table[:, j].tolist()
        if len(set(column)) > 1:
            groups: dict = {}
            for rank, h in enumerate(column):
                groups.setdefault(h, []).append(rank)
            out[name] = list(groups.values())
    return out


def check_same_config(cfg) -> None:
    """Collective over the world (nothing on one rank): raise ConfigError on every rank, naming the
    options that differ and the ranks on each side, unless every rank resolved the same config."""
    group = _world_group()
    if group is None:
        return
    values = option_values(cfg)
    hashes = [_hash63(f"{k}={v}") for k, v in values.items()]
    whole, n = _hash63(json.dumps(values, sort_keys=True)), len(hashes)
    votes = torch.tensor([whole, -whole, n, -n], dtype=torch.int64)
    comms.all_reduce_max_(votes, group)  # MAX of [h, -h, n, -n]: the world's max and -min of both
    if int(votes[0]) == -int(votes[1]):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    if int(votes[2]) != -int(votes[3]):
        raise ConfigError(f"the ranks run different versions of areal_lce (configs of {-int(votes[3])} to "
                          f"{int(votes[2])} options; rank {rank} has {n}): install one version on every node")
    table = torch.zeros(world, n, dtype=torch.int64)
    table[rank] = torch.tensor(hashes, dtype=torch.int64)
    comms.all_reduce_sum_(table, group)  # each rank filled its own row: the sum is every rank's row
    differ = differing_options(table, list(values))
    shown = [f"{name} (ranks {' | '.join(','.join(map(str, g)) for g in groups)}; rank {rank} has {values[name]})"
             for name, groups in list(differ.items())[:_SHOWN_KEYS]]
    more = f" and {len(differ) - _SHOWN_KEYS} more" if len(differ) > _SHOWN_KEYS else ""
    raise ConfigError(f"the {world} ranks run different configs: {'; '.join(shown)}{more}. Launch every rank "
                      "with the same CONFIG.yaml and overrides")


# ------------------------------------------------------------------------------------------ stop on signal

class StopOnSignal:
    """Context manager: while open, SIGINT and SIGTERM only record the signal (the first one); `agreed()`
    at a step boundary returns the signal any rank got (0 if none), the same on every rank. A second
    signal raises Interrupted(signum, None) at once. The previous handlers come back on exit. Outside the
    main thread (where Python cannot install handlers) signals keep their usual effect."""

    def __init__(self):
        self.signum = 0
        self._previous: dict = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum:  # a second signal: stop now, without waiting for the step boundary
            raise Interrupted(signum, None)
        self.signum = signum  # only a flag: the ranks act on it together at the step boundary

    def agreed(self) -> int:
        """Collective at a step boundary (one all-reduce MAX of one int64 when the job has several ranks):
        the largest signal number any rank recorded, 0 if none."""
        group = _world_group()
        if group is None:
            return self.signum
        t = torch.tensor([self.signum], dtype=torch.int64)
        comms.all_reduce_max_(t, group)  # any rank's signal stops every rank (SIGTERM 15 over SIGINT 2)
        return int(t[0])
