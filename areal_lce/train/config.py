"""Job configuration: nested dataclasses, a YAML loader and dotted command-line overrides.

A job is one `JobConfig`. YAML only sets fields that exist (unknown keys are errors naming the full
dotted option), overrides `a.b.c=value` are typed by the dataclass field they target, and every
dataclass checks its own cross-field constraints in `__post_init__`, naming the offending option.

    cfg = load_config("configs/sft_tiny.yaml", ["trainer.steps=20", "engine.use_fused_linear_ce=false"])
    print(format_help(JobConfig))   # every option with its type, default and help string
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import yaml

from areal_lce.megatron.config import EngineConfig

from .rl_config import RLConfig

JOBS = ("sft", "grpo", "ppo")
DATA_FORMATS = ("prompt_response", "text")


class ConfigError(ValueError):
    """A configuration problem; the message names the offending option."""


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class DataConfig:
    path: str = field(
        default="builtin:sft_tiny.jsonl",
        metadata=_help("JSONL file, one example per line; 'builtin:NAME' reads the file NAME shipped in "
                       "areal_lce/train/data/"),
    )
    format: str = field(
        default="prompt_response",
        metadata=_help(f"one of {DATA_FORMATS}: prompt_response = loss on the response tokens only "
                       "(keys prompt_key/response_key); text = loss on every token (key text_key)"),
    )
    tokenizer: str = field(
        default="builtin",
        metadata=_help("local Hugging Face tokenizer directory (AutoTokenizer.from_pretrained), or "
                       "'builtin' for the offline byte-level tokenizer (259 ids)"),
    )
    max_seq_len: int = field(
        default=256, metadata=_help("examples are truncated to this many tokens (prompt + response)")
    )
    shuffle_seed: int = field(
        default=1234, metadata=_help("seed of the per-epoch example order (the order is a pure function "
                                     "of seed, epoch and step, so a resumed run sees the same batches)")
    )
    shuffle: bool = field(default=True, metadata=_help("shuffle the examples every epoch"))
    prompt_key: str = field(default="prompt", metadata=_help("JSON key of the prompt (prompt_response)"))
    response_key: str = field(default="response", metadata=_help("JSON key of the response (prompt_response)"))
    text_key: str = field(default="text", metadata=_help("JSON key of the text (format=text)"))
    add_bos: bool = field(default=True, metadata=_help("prepend the tokenizer's BOS id when it has one"))
    add_eos: bool = field(default=True, metadata=_help("append the tokenizer's EOS id (trained on)"))
    pad_to_multiple_of: int = field(
        default=1, metadata=_help("right-pad each micro-batch to a multiple of this length (the job also "
                                  "rounds up to tensor_parallel under sequence parallelism)")
    )

    def __post_init__(self):
        if self.format not in DATA_FORMATS:
            raise ConfigError(f"data.format={self.format!r}: expected one of {DATA_FORMATS}")
        if not self.path:
            raise ConfigError("data.path is empty: give a JSONL file or 'builtin:NAME'")
        if not self.tokenizer:
            raise ConfigError("data.tokenizer is empty: give a tokenizer directory or 'builtin'")
        if self.max_seq_len < 2:
            raise ConfigError(f"data.max_seq_len={self.max_seq_len} must be >= 2 (one input, one target)")
        if self.pad_to_multiple_of < 1:
            raise ConfigError(f"data.pad_to_multiple_of={self.pad_to_multiple_of} must be >= 1")


@dataclass
class TrainerConfig:
    steps: int = field(default=60, metadata=_help("optimizer steps of the whole run"))
    global_batch_size: int = field(
        default=8, metadata=_help("examples per optimizer step, summed over data-parallel ranks")
    )
    micro_batch_size: int = field(
        default=4, metadata=_help("examples per forward/backward; global_batch_size must be a multiple "
                                  "of micro_batch_size x data-parallel size")
    )
    output_dir: str = field(
        default="runs/sft_tiny",
        metadata=_help("run directory: metrics.jsonl, metrics.png, config.yaml, checkpoints/"),
    )
    save_interval: int = field(
        default=0, metadata=_help("save a checkpoint every this many steps (0: only at the end)")
    )
    save_final: bool = field(default=True, metadata=_help("save a checkpoint after the last step"))
    resume: Union[bool, str] = field(
        default=False,
        metadata=_help("true: resume from the last checkpoint in output_dir (error if none); 'auto': "
                       "resume when one exists, else start fresh; false: start fresh"),
    )
    stop_at: int = field(
        default=0, metadata=_help("end this invocation right after this step, without the final save, "
                                  "as if the process were killed (0: off); used to exercise resume")
    )
    log_interval: int = field(default=1, metadata=_help("print a metrics line every this many steps"))
    seed: int = field(default=1234, metadata=_help("seeds python's and torch's RNGs once the engine is built "
                                                   "(engine.seed seeds the model init)"))
    progress: bool = field(default=True, metadata=_help("show a tqdm progress bar on rank 0"))
    plot: bool = field(default=True, metadata=_help("write metrics.png (matplotlib) at the end of the run"))
    sample_prompts: int = field(
        default=0, metadata=_help("after the last step, greedily complete this many prompts of the dataset "
                                  "(file order) and print them with their reference responses; also "
                                  "written to samples.jsonl (0: off; format prompt_response only)")
    )

    def __post_init__(self):
        if self.steps < 1:
            raise ConfigError(f"trainer.steps={self.steps} must be >= 1")
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ConfigError("trainer.global_batch_size and trainer.micro_batch_size must be >= 1")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"trainer.global_batch_size={self.global_batch_size} is not a multiple of "
                              f"trainer.micro_batch_size={self.micro_batch_size}")
        if isinstance(self.resume, str) and self.resume != "auto":
            raise ConfigError(f"trainer.resume={self.resume!r}: expected true, false or 'auto'")
        for name in ("save_interval", "stop_at"):
            if getattr(self, name) < 0:
                raise ConfigError(f"trainer.{name}={getattr(self, name)} must be >= 0")
        if self.log_interval < 1:
            raise ConfigError(f"trainer.log_interval={self.log_interval} must be >= 1")
        if not self.output_dir:
            raise ConfigError("trainer.output_dir is empty")




@dataclass
class JobConfig:
    job: str = field(default="sft", metadata=_help(f"which job runs, one of {JOBS}"))
    engine: EngineConfig = field(default_factory=EngineConfig,
                                 metadata=_help("model, parallelism, optimizer, fused-op route"))
    data: DataConfig = field(default_factory=DataConfig, metadata=_help("dataset and tokenizer"))
    trainer: TrainerConfig = field(default_factory=TrainerConfig, metadata=_help("loop, batching, checkpoints"))
    rl: RLConfig = field(default_factory=RLConfig, metadata=_help("RL jobs only (grpo, ppo)"))

    def __post_init__(self):
        if self.job not in JOBS:
            raise ConfigError(f"job={self.job!r}: expected one of {JOBS}")
        if self.data.max_seq_len > self.engine.model.max_seq_len:
            raise ConfigError(f"data.max_seq_len={self.data.max_seq_len} exceeds "
                              f"engine.model.max_seq_len={self.engine.model.max_seq_len}")
        optim = self.engine.optim
        if self.job == "sft" and optim.total_steps != self.trainer.steps:
            # One optimizer step per SFT step: the lr schedule spans the run (trainer.steps wins).
            optim.total_steps = self.trainer.steps
            if optim.lr_schedule == "cosine" and optim.warmup_steps >= optim.total_steps:
                raise ConfigError(f"engine.optim.warmup_steps={optim.warmup_steps} must be < trainer.steps="
                                  f"{self.trainer.steps} for the cosine schedule")
        if self.trainer.sample_prompts < 0:
            raise ConfigError(f"trainer.sample_prompts={self.trainer.sample_prompts} must be >= 0")
        if self.trainer.sample_prompts and self.data.format != "prompt_response":
            raise ConfigError("trainer.sample_prompts needs data.format=prompt_response (prompts to complete)")
        if self.trainer.stop_at and self.trainer.stop_at >= self.trainer.steps:
            raise ConfigError(f"trainer.stop_at={self.trainer.stop_at} must be < trainer.steps="
                              f"{self.trainer.steps} (0 disables it)")


# ----------------------------------------------------------------------------------------------
# Generic machinery: dict -> dataclass with type checks, typed string overrides, help listing.
# ----------------------------------------------------------------------------------------------

_NONE_WORDS = ("none", "null", "~")
_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _check_value(tp, value, key: str):
    """Return `value` as type `tp` (YAML values: int widens to float, list to tuple), else raise."""
    if dataclasses.is_dataclass(tp):
        raise ConfigError(f"option '{key}' is a section; set its fields ({key}.FIELD)")
    if tp is Any:
        return value
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_value(arg, value, key)
            except ConfigError:
                pass
        raise ConfigError(f"option '{key}' expects {_type_name(tp)}, got {value!r}")
    origin = typing.get_origin(tp)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"option '{key}' expects a mapping ({_type_name(tp)}), got {value!r}")
        return dict(value)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"option '{key}' expects a list ({_type_name(tp)}), got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"option '{key}' expects {len(args)} values, got {len(value)}")
            return tuple(_check_value(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        elem = args[0] if args else Any
        items = [_check_value(elem, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"option '{key}' expects {_type_name(tp)}, got {value!r}")


def from_dict(cls, data: Optional[dict], prefix: str = ""):
    """Build dataclass `cls` from a nested dict; unknown keys and wrong types raise ConfigError."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"section '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown option '{prefix}{key}' (valid in this section: {', '.join(names)})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _check_value(tp, value, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # a nested section's own check: say which section
        where = prefix.rstrip(".") or "<root>"
        raise ConfigError(f"invalid section '{where}': {e}") from e


def to_dict(cfg) -> dict:
    """Plain nested dict of a config (tuples as lists, so it round-trips through YAML)."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(cfg))


def dump_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _field_type(cls, dotted: str):
    """Type of the field at dotted path `dotted` below dataclass `cls`; unknown parts raise."""
    parts = dotted.split(".")
    tp = cls
    for i, part in enumerate(parts):
        if typing.get_origin(tp) is dict or tp is dict or tp is Any:
            return Any  # a key inside a mapping option (e.g. rl.task_options.n=3): YAML-typed value
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"unknown option '{dotted}': '{'.'.join(parts[:i])}' is not a section")
        names = [f.name for f in dataclasses.fields(tp) if f.init]
        if part not in names:
            where = ".".join(parts[:i]) or "<root>"
            raise ConfigError(f"unknown option '{dotted}' (valid in '{where}': {', '.join(names)})")
        tp = _hints(tp)[part]
    return tp


def parse_value(tp, text: str, key: str):
    """Parse the command-line string `text` as a value of type `tp` (the field's annotation)."""
    s = text.strip()
    if dataclasses.is_dataclass(tp):
        raise ConfigError(f"option '{key}' is a section; override its fields ({key}.FIELD=...)")
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if type(None) in typing.get_args(tp) and s.lower() in _NONE_WORDS:
            return None
        for arg in args:
            try:
                return parse_value(arg, s, key)
            except ConfigError:
                pass
        raise ConfigError(f"option '{key}' expects {_type_name(tp)}, got {text!r}")
    origin = typing.get_origin(tp)
    if origin is dict or tp is dict:
        try:
            raw = yaml.safe_load(s) if s else {}
        except yaml.YAMLError as e:
            raise ConfigError(f"option '{key}': cannot parse mapping {text!r}: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"option '{key}' expects a mapping like {{a: 1}}, got {text!r}")
        return raw
    if origin in (list, tuple):
        if s.startswith("["):
            try:
                raw = yaml.safe_load(s)
            except yaml.YAMLError as e:
                raise ConfigError(f"option '{key}': cannot parse list {text!r}: {e}") from e
            if not isinstance(raw, list):
                raise ConfigError(f"option '{key}' expects a list, got {text!r}")
            raw = [str(x) for x in raw]
        else:
            raw = [p for p in s.split(",") if p.strip()] if s else []
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(raw):
                raise ConfigError(f"option '{key}' expects {len(args)} comma-separated values, got {text!r}")
            return tuple(parse_value(a, r, key) for a, r in zip(args, raw))
        elem = args[0] if args else str
        items = [parse_value(elem, r, key) for r in raw]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if s.lower() in _TRUE_WORDS:
            return True
        if s.lower() in _FALSE_WORDS:
            return False
        raise ConfigError(f"option '{key}' expects a bool (true/false), got {text!r}")
    if tp is int:
        try:
            return int(s)
        except ValueError:
            try:
                f = float(s)  # accept 1e6
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
            raise ConfigError(f"option '{key}' expects an int, got {text!r}") from None
    if tp is float:
        try:
            return float(s)
        except ValueError:
            raise ConfigError(f"option '{key}' expects a float, got {text!r}") from None
    if tp is str:
        return text
    if tp is Any:
        return yaml.safe_load(s)
    raise ConfigError(f"option '{key}' has unsupported type {_type_name(tp)} for command-line overrides")


def apply_overrides(data: dict, overrides: Sequence[str], cls=None) -> dict:
    """Set dotted `key=value` overrides into the nested dict `data` (typed by `cls`'s fields)."""
    cls = JobConfig if cls is None else cls
    data = {} if data is None else data
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.steps=10)")
        key, text = item.split("=", 1)
        key = key.strip().lstrip("-")
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        value = parse_value(_field_type(cls, key), text, key)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(f"section '{part}' in the YAML is not a mapping (override {key})")
            node = nxt
        node[parts[-1]] = value
    return data


def load_yaml(path: Union[str, Path]) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    with open(path) as f:
        data = yaml.safe_load(f)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def load_config(path: Union[str, Path, None] = None, overrides: Sequence[str] = (), cls=None):
    """YAML file (optional) + dotted overrides -> validated config (JobConfig by default)."""
    cls = JobConfig if cls is None else cls
    data = load_yaml(path) if path is not None else {}
    data = apply_overrides(data, overrides, cls)
    return from_dict(cls, data)


def iter_fields(cls, prefix: str = ""):
    """Yield (dotted name, type, default, help) for every leaf option below dataclass `cls`."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, name + ".")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        yield name, tp, default, f.metadata.get("help", "")


def format_help(cls=None) -> str:
    """Text listing of every option: dotted name, type, default and help string."""
    cls = JobConfig if cls is None else cls
    lines = []
    for name, tp, default, text in iter_fields(cls):
        shown = "<required>" if default is dataclasses.MISSING else repr(default)
        lines.append(f"  {name}  ({_type_name(tp)}, default {shown})")
        if text:
            lines.append(f"      {text}")
    return "\n".join(lines)


def format_markdown(cls=None) -> str:
    """Markdown tables of every option (one per top-level section), from the help strings."""
    cls = JobConfig if cls is None else cls
    out, section = [], None
    for name, tp, default, text in iter_fields(cls):
        top = name.split(".")[0] if "." in name else ""
        if top != section:
            section = top
            out += ["", f"### `{top}`" if top else "### top level", "",
                    "| option | type | default | meaning |", "|---|---|---|---|"]
        shown = "required" if default is dataclasses.MISSING else repr(default)
        cell = text.replace("|", "\\|")
        out.append(f"| `{name}` | {_type_name(tp)} | `{shown}` | {cell} |")
    return "\n".join(out).strip() + "\n"
