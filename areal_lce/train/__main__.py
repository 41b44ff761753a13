"""Entry point of the train jobs.

    torchrun --nproc_per_node=N -m areal_lce.train CONFIG.yaml [key=value ...]
    python -m areal_lce.train                      # the embedded default: configs/sft_tiny.yaml
    python -m areal_lce.train builtin:grpo_tiny.yaml   # a config shipped with the package, from any directory
    python -m areal_lce.train --help               # every option with its help string
    python -m areal_lce.train help-markdown        # the same as Markdown tables (docs/training.md)

`job:` in the config picks the job: sft -> areal_lce.train.sft, grpo | ppo -> areal_lce.train.rl, distill ->
areal_lce.train.distill, all run by the loop of areal_lce.train.loop.

Exit status: 0 done; 2 a config error (`config error: ...`, at load or when the ranks' configs differ);
1 any other error, printed as one line `error: ...` (prefixed `[rank R]` under torchrun) -- `--debug` or
AREAL_LCE_DEBUG=1 raises it with its traceback instead; 130 / 143 stopped by SIGINT / SIGTERM (after a
checkpoint when a step boundary was reached, see loop.py).
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from .config import ConfigError, JobConfig, format_help, format_markdown, load_config
from .ranks import Interrupted

# The shipped job configs: package data of an installed areal_lce; in a checkout areal_lce/configs is a
# symlink to the repository's configs/ (the one copy of each file).
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "sft_tiny.yaml"
BUILTIN = "builtin:"
USAGE = """usage: torchrun --nproc_per_node=N -m areal_lce.train [CONFIG.yaml] [key=value ...]
       python -m areal_lce.train [CONFIG.yaml] [key=value ...]   (single process)

Without CONFIG.yaml the embedded default configs/sft_tiny.yaml runs. CONFIG.yaml is a path, or
builtin:NAME for a config shipped with the package (the repository's configs/NAME), from any directory.
Overrides use dotted option names, e.g. trainer.steps=20 engine.use_fused_linear_ce=false
engine.parallel.tensor_parallel=2.
--debug (or AREAL_LCE_DEBUG=1) shows the traceback of an error instead of its one-line message.
"""
DEBUG_ENV = "AREAL_LCE_DEBUG"
FLAGS = ("-h", "--help", "help", "--debug")


def parse_args(argv: Sequence[str]):
    """-> (config path or None, overrides, wants_help); `--debug` is read by `main`."""
    argv = list(argv)
    wants_help = any(a in ("-h", "--help", "help") for a in argv)
    argv = [a for a in argv if a not in FLAGS]
    path = None
    if argv and "=" not in argv[0]:
        path = argv.pop(0)
    for a in argv:
        if "=" not in a:
            raise ConfigError(f"unexpected argument {a!r}: give CONFIG.yaml first, then key=value overrides")
    return path, argv, wants_help


def config_path(arg: Optional[str]) -> Path:
    """The config file of the CONFIG.yaml argument: a path, `builtin:NAME` (a shipped config), or None for
    the embedded default."""
    if arg is not None and not arg.startswith(BUILTIN):
        return Path(arg)
    path = DEFAULT_CONFIG if arg is None else CONFIG_DIR / arg[len(BUILTIN):]
    if path.parent != CONFIG_DIR or not path.is_file():
        shipped = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))) or f"none: {CONFIG_DIR} is missing"
        what = "the embedded default" if arg is None else repr(arg)
        raise ConfigError(f"{what}: no shipped config {path.name!r} in {CONFIG_DIR} (shipped: {shipped})")
    return path


# The warnings known to be noise here: (module that issues it, message), both regular expressions matched
# from the start. Anything else, the user's own deprecations and the project's included, is shown.
KNOWN_NOISE = (
    (r"megatron\.core(\..*)?", r".*(Apex|Transformer Engine|absl\.logging).* not installed"),  # optional packages
    (r"megatron\.core\.tensor_parallel\.layers", r".*tp_group is None"),
    (r"megatron\.core\.transformer\.mlp", r".*requires ffn_hidden_size"),
    (r"megatron\.core\.inference\.contexts", r"The following imports from `dynamic_context\.py`"),
    (r"torch\.jit\._script", r"`torch\.jit\.script_method` is deprecated"),  # megatron-core's jit helpers
)


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """warnings.formatwarning without the source line that the default one prints under the message."""
    return f"{filename}:{lineno}: {category.__name__}: {message}\n"


def quiet_known_warnings() -> None:
    """Hide the start-up notices megatron-core and torch issue on this machine (KNOWN_NOISE, by module and
    message), and print every other warning on one line."""
    for module, message in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message, module=module + r"\Z")
    warnings.formatwarning = one_line_warning


def limit_cpu_threads() -> None:
    """CPU-only runs use one intra-op thread per process unless OMP_NUM_THREADS says otherwise.

    The CPU models here are tiny: a second thread gains little, and on a loaded 2-core machine the
    OpenMP workers' busy-waiting made the default SFT run 3x slower (2m33s vs 51s, same losses).
    """
    import os

    import torch

    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def run_job(cfg: JobConfig) -> dict:
    if cfg.job == "sft":
        from .sft import run
    elif cfg.job == "distill":
        from .distill import run
    else:
        from .rl import run
    return run(cfg)


def _rank_prefix() -> str:
    """`[rank R] ` under a launcher with several ranks (every rank prints its own error), else ''."""
    return f"[rank {os.environ.get('RANK', '0')}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


def error_line(e: BaseException) -> str:
    """One line for an error after start-up: our checks raise ValueError / OSError subclasses whose
    message names the option, file or tensor; anything else also shows its type."""
    what = "config error" if isinstance(e, ConfigError) else "error"
    text = str(e) if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"
    return f"{_rank_prefix()}{what}: {text} (traceback: --debug or {DEBUG_ENV}=1)"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if list(argv) == ["help-markdown"]:  # the options reference of docs/training.md
        print(format_markdown(JobConfig), end="")
        return 0
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        path, overrides, wants_help = parse_args(argv)
        if wants_help:
            print(USAGE)
            print("options:")
            print(format_help(JobConfig))
            return 0
        cfg = load_config(config_path(path), overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    quiet_known_warnings()
    limit_cpu_threads()
    try:
        run_job(cfg)
    except Interrupted as e:  # the loop saved and printed the resume line when a step boundary was reached
        if e.step is None:
            print(f"{_rank_prefix()}{e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C before the first step: nothing to save
        if debug:
            raise
        print(f"{_rank_prefix()}interrupted before the first step; nothing was saved", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        print(error_line(e), file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
