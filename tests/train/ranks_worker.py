"""One rank of a two-rank train job run through the entry point (`areal_lce.train.__main__.main`), for the
tests of what the ranks agree on (tests/train/test_config_safety.py, tests/train/test_interrupt.py).

    torchrun --nproc_per_node=2 tests/train/ranks_worker.py MODE OUT [key=value ...]

MODE config   rank r adds `engine.optim.lr=0.00{r+1}` to the overrides: the ranks run different configs.
MODE sigterm  rank 1 sends itself SIGTERM while it runs step 2, before the step's work (rank 0 gets
              no signal): the ranks must agree at the end of step 2, save, and both exit 143.
Each rank writes OUT/rank{r}.json with main's return value. SIGTERM is ignored outside the run loop
(whose handler the loop installs and removes), so that torchrun's SIGTERM to a rank still finishing,
sent when the other rank exits first, does not cut off its result.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def main() -> None:
    mode, out, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    rank = int(os.environ["RANK"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from areal_lce.train import __main__ as entry

    if mode == "config":
        overrides = overrides + [f"engine.optim.lr=0.00{rank + 1}"]
    elif mode == "sigterm":
        from areal_lce.train import sft

        step = sft.SFTJob.step

        def signalled_step(self, n):
            if n == 2 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # delivered now: the handler only records it
            return step(self, n)

        sft.SFTJob.step = signalled_step
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    rc = entry.main(overrides)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "rc": rc}))
    sys.exit(rc)


if __name__ == "__main__":
    main()
