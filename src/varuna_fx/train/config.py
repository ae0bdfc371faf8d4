"""``varuna-fx train``'s configuration: every key, its default and meaning, in one dataclass.

A run is configured by a TOML file (as torchtitan's) and ``--key value`` flags on top of it,
flags winning. Every key of :class:`TrainConfig` is both: ``global_batch_size = 64`` in the file
(at the top level or under its group's table, ``[training]``), ``--global-batch-size 64`` (or
``--global_batch_size=64``) on the command line. The metadata of each field (group, help, what
values it takes) is the one source of the parser, ``--help``, ``--print-config`` and the key
table of docs/API.md (a test compares them).

Values that let the planner or the data decide are written ``"auto"`` (TOML has no null);
optional paths are ``""`` when unset. Everything is checked here, before a process is
launched: a wrong key names the close ones, a wrong value says what the key takes.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..capture.trace import TRACERS
from ..errors import InputError
from ..runtime.precision import PRECISIONS
from ..schedule import DEFAULT_SCHEDULE, schedule_choices
from ..world.launch_options import OPTIONS

if sys.version_info >= (3, 11):
    import tomllib
else:  # python 3.10: the same parser, as a package (a dependency there, pyproject.toml)
    import tomli as tomllib

AUTO = "auto"
GROUPS = ("model", "data", "training", "optimizer", "compile", "checkpoint", "monitor",
          "launch")
BUILTIN_GPT = "gpt"
STDLIB_CORPUS = "stdlib"
# keys that size the built-in GPT: refused with another model, which brings its own sizes
_HELP_WIDTH = 100
GPT_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "dropout")


def key(default: Any, group: str, help: str, kind: str | None = None, *,
        choices: tuple[Any, ...] = (), low: float | None = None,
        high: float | None = None) -> Any:
    """A config field: ``kind`` is int, float, str, bool, or one of those with "|auto"
    (inferred from the default when not given); ``choices`` limits the values."""
    if kind is None:
        kind = {bool: "bool", int: "int", float: "float", str: "str"}[type(default)]
    return field(default=default, metadata={"group": group, "help": help, "kind": kind,
                                            "choices": choices, "low": low, "high": high})


def launch_key(name: str) -> Any:
    """A ``[launch]`` key: the launch option of that name, as ``varuna-fx run`` takes it."""
    option = OPTIONS[name]
    return key(option.default, "launch", option.help, option.kind, low=option.low)


@dataclass(frozen=True)
class TrainConfig:
    """One training run (docs/API.md, "The train command", documents every key)."""

    # -- model
    model: str = key(BUILTIN_GPT, "model", "gpt (the built-in GPT, sized by the keys below), a "
                     "Hugging Face config.json (or its directory), or module:factory (returns "
                     "an nn.Module taking token ids, or a tuple whose first item is one; "
                     "called with seq_len= and vocab_size= where its signature takes them; a "
                     "forward(idx, targets) is fed the next tokens and its own loss trained)")
    n_layer: int = key(4, "model", "built-in GPT: transformer blocks", low=1)
    n_head: int = key(4, "model", "built-in GPT: attention heads (divides n_embd)", low=1)
    n_embd: int = key(128, "model", "built-in GPT: embedding width", low=1)
    vocab_size: Any = key(AUTO, "model", "built-in GPT (or a factory taking it): vocabulary; "
                          "auto: the data's (256 for text read as bytes; a .bin token file "
                          "needs it given)", "int|auto",
                          low=2)
    dropout: float = key(0.0, "model", "built-in GPT: dropout probability", low=0.0, high=1.0)
    init_from: str = key("", "model", "a Hugging Face checkpoint directory (safetensors) to "
                         "start from; ignored when --out holds a checkpoint to resume", "path")
    # -- data
    data: str = key(STDLIB_CORPUS, "data", "stdlib (the Python standard library's sources, "
                    "read as bytes: no download), a token file (.bin of uint16/uint32), a text "
                    "(.txt) or JSON Lines (.jsonl) file with --tokenizer, a datasets "
                    "save_to_disk folder or .parquet file (pip install varuna_fx[datasets]), "
                    "or any other file read as bytes")
    tokenizer: str = key("", "data", "a local folder holding a Hugging Face tokenizer "
                         "(tokenizer.json, or what transformers' AutoTokenizer reads from "
                         "files): text and .jsonl data are tokenized with it once, cached under "
                         "$VARUNA_FX_CACHE_DIR/tokens (empty: text is read as bytes)", "path")
    text_key: str = key("text", "data", ".jsonl data (and datasets folders / .parquet): the "
                        "field holding each document's text")
    corpus_bytes: int = key(4_000_000, "data", "stdlib: bytes of the corpus (the first files "
                            "in sorted order, cut at this size)", low=1024)
    data_dtype: str = key(AUTO, "data", ".bin token files: uint16 / uint32 / auto (inferred)",
                          choices=(AUTO, "uint16", "uint32"))
    seq_len: int = key(64, "data", "tokens per sample (the built-in GPT's context)", low=1)
    shuffle: bool = key(True, "data", "shuffle the samples each epoch (order of seed, epoch)")
    num_workers: int = key(0, "data", "data loader worker processes", low=0)
    log_samples: bool = key(False, "data", "write each step's global batch (dataset indices) "
                            "to samples.jsonl in --out")
    eval_data: str = key("", "data", "held-out data for validation, a file as data takes it "
                         "(validated every eval_every steps)", "path")
    eval_fraction: float = key(0.0, "data", "hold out this fraction of data's samples, taken "
                               "from its end and never trained on, for validation (0: none)",
                               low=0.0, high=0.5)
    # -- training
    steps: int = key(600, "training", "optimizer steps of the whole run (the LR schedule's "
                     "length)", low=1)
    global_batch_size: int = key(16, "training", "samples per step over all replicas", low=1)
    seed: int = key(0, "training", "initial weights and the data order", low=0)
    stop_at: int = key(0, "training", "save and stop after this step (0: run to the end); the "
                       "same command without it resumes", low=0)
    eval_every: int = key(0, "training", "validation loss (val_loss in metrics.jsonl) every "
                          "this many steps and at the last one, on held-out batches (eval_data "
                          "or eval_fraction); 0: none", low=0)
    eval_batches: int = key(8, "training", "global batches of held-out data per validation, "
                            "the same ones each time (fewer when it holds fewer)", low=1)
    # -- optimizer (AdamW) and LR schedule
    lr: float = key(3e-3, "optimizer", "peak learning rate", low=0.0)
    beta1: float = key(0.9, "optimizer", "AdamW beta1", low=0.0, high=1.0)
    beta2: float = key(0.95, "optimizer", "AdamW beta2", low=0.0, high=1.0)
    eps: float = key(1e-8, "optimizer", "AdamW epsilon", low=0.0)
    weight_decay: float = key(0.1, "optimizer", "AdamW weight decay, on weights of 2 or more "
                              "dimensions (not biases or norms)", low=0.0)
    grad_clip: float = key(1.0, "optimizer", "clip the gradients' global norm to this (0: off)",
                           low=0.0)
    lr_schedule: str = key("cosine", "optimizer", "after the warmup: cosine / linear (down to "
                           "min_lr_ratio x lr) / constant", choices=("cosine", "linear",
                                                                     "constant"))
    warmup_steps: Any = key(AUTO, "optimizer", "linear warmup steps; auto: 5% of steps",
                            "int|auto", low=0)
    min_lr_ratio: float = key(0.1, "optimizer", "the schedule's final LR over lr", low=0.0,
                              high=1.0)
    # -- compile's options
    stages: Any = key(AUTO, "compile", "pipeline stages P (auto: the planner's)", "int|auto",
                      low=1)
    data_parallel: Any = key(AUTO, "compile", "data-parallel replicas D (auto: the planner's)",
                             "int|auto", low=1)
    # auto: the planner prices this machine's per-action and per-operation costs
    # (planner/machine.py), so it no longer picks micro-batches of 1 that run 2-3x slower than
    # predicted (bench/RESULTS.md, "The planner against the machine")
    micro_batch_size: Any = key(AUTO, "compile", "samples per micro-batch (auto: the planner's); "
                                "divides the global batch", "int|auto", low=1)
    grad_accum_steps: Any = key(AUTO, "compile", "micro-batches per replica per step, their "
                                "gradients accumulated: global_batch_size = micro_batch_size x "
                                "grad_accum_steps x data_parallel (auto: the planner's; given "
                                "alone, micro_batch_size follows from it)", "int|auto", low=1)
    stages_per_rank: Any = key(1, "compile", "virtual stages per rank (auto: the schedule's)",
                               "int|auto", low=1)
    schedule: str = key(DEFAULT_SCHEDULE, "compile", "micro-batch schedule: "
                        + ", ".join(schedule_choices()), choices=tuple(schedule_choices()))
    recompute: Any = key(AUTO, "compile", "recompute activations: true / false / auto",
                         "bool|auto")
    shard_optimizer: Any = key(AUTO, "compile", "ZeRO-1 over the replicas: true / false / auto "
                               "(auto: when D > 1)", "bool|auto")
    precision: str = key("fp32", "compile", "fp32 / bf16 / fp16", choices=tuple(PRECISIONS))
    tracer: str = key(AUTO, "compile", "fx / export / auto", choices=TRACERS)
    offload_stash: bool = key(False, "compile", "keep stashed activations in host memory")
    compile_stages: str = key(AUTO, "compile", "run each stage through torch.compile / "
                              "inductor: on / off / auto (auto: on CUDA; on CPU where profile=true "
                              "measured a gain that the run's steps pay the compile back for)",
                              choices=("on", "off", AUTO))
    compile_wait: bool = key(False, "compile", "compiled stages: compile each at its first "
                             "call, the first step waiting (false: eager while they compile "
                             "in the background, compiled from a later step)")
    timeout: Any = key(AUTO, "compile", "seconds a rank waits for a peer (auto: "
                       "$VARUNA_FX_TIMEOUT or the default)", "float|auto", low=0.0)
    profile: bool = key(False, "compile", "measure this device for planning (cached) instead "
                        "of FLOP estimates")
    # -- checkpoints and output
    out: str = key("runs/train", "checkpoint", "the run's folder: checkpoints/, metrics.jsonl, "
                   "charts/*.png, config.toml; a checkpoint there is resumed", "path")
    checkpoint_every: int = key(100, "checkpoint", "save every this many steps (0: only at the "
                                "end and when stopped)", low=0)
    first_checkpoint: Any = key(AUTO, "checkpoint", "save once after this step too, before "
                                "checkpoint_every's first (auto: in place, checkpoint_every / 10, "
                                "at least 1, so a job that loses state early restarts from there, "
                                "not step 0; else none; 0: none)", "int|auto", low=0)
    keep_checkpoints: int = key(2, "checkpoint", "newest checkpoints kept (0: all)", low=0)
    keep_best: bool = key(False, "checkpoint", "also keep the checkpoint of the lowest "
                          "validation loss, in best/ under --out (best/best.json says its step "
                          "and loss); needs eval_every")
    export: str = key("", "checkpoint", "at the end, write the model to this directory as "
                      "Hugging Face safetensors", "path")
    # -- watching
    print_every: int = key(10, "monitor", "plain progress lines every this many steps (when "
                           "not on a terminal)", low=1)
    live: Any = key(AUTO, "monitor", "the live progress line: true / false / auto (on a "
                    "terminal)", "bool|auto")
    tensorboard: Any = key(AUTO, "monitor", "TensorBoard under --out: true / false / auto "
                           "(when installed)", "bool|auto")
    wandb: bool = key(False, "monitor", "log to Weights & Biases too (pip install "
                      "'varuna_fx[wandb]'; offline unless WANDB_MODE says otherwise)")
    charts: bool = key(True, "monitor", "draw charts/training.png and charts/timeline.png at "
                       "the end")
    peak_flops: Any = key(AUTO, "monitor", "a device's peak FLOP/s for MFU (auto: the "
                          "monitor's table)", "float|auto", low=0.0)
    # -- launching: `varuna-fx run`'s options, declared once (world/launch_options.py)
    nproc: int = launch_key("nproc")
    elastic: bool = launch_key("elastic")
    in_place: bool = launch_key("in_place")
    store_host: Any = launch_key("store_host")
    nnodes: str = launch_key("nnodes")
    rdzv_endpoint: str = launch_key("rdzv_endpoint")
    rdzv_id: str = launch_key("rdzv_id")
    local_addr: str = launch_key("local_addr")
    max_restarts: int = launch_key("max_restarts")
    torchrun_args: str = launch_key("torchrun_args")

    def compile_options(self) -> dict[str, Any]:
        """The keyword arguments of ``vf.compile`` these keys set (besides the model's)."""
        auto = {k: (None if getattr(self, k) == AUTO else getattr(self, k))
                for k in ("stages", "data_parallel", "micro_batch_size", "grad_accum_steps",
                          "stages_per_rank", "timeout")}
        return dict(auto, global_batch_size=self.global_batch_size, schedule=self.schedule,
                    recompute=self.recompute, shard_optimizer=self.shard_optimizer,
                    precision=self.precision, tracer=self.tracer,
                    offload_stash=self.offload_stash, profile=self.profile,
                    compile_stages=self.compile_stages, compile_wait=self.compile_wait,
                    planned_steps=self.steps)

    @property
    def warmup(self) -> int:
        return max(1, self.steps // 20) if self.warmup_steps == AUTO else self.warmup_steps

    @property
    def first_checkpoint_step(self) -> int:
        """The step of the early first checkpoint (0: none). In place, state lost with its
        only holders restarts the job from the latest checkpoint, and before the first one
        from step 0: auto takes one a tenth of the way to the first periodic one."""
        if self.first_checkpoint != AUTO:
            return self.first_checkpoint
        return max(1, (self.checkpoint_every or self.steps) // 10) if self.in_place else 0

    def fingerprint(self) -> dict[str, str]:
        """What a process joining a running in-place job must share with it
        (``world/admission.py``): every key but the per-machine ones."""
        return {f"train.{name}": repr(getattr(self, name)) for name in FIELDS
                if name not in PER_MACHINE}


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# keys each machine of one job may set for itself: where it runs, how it launches, what it
# shows; every other key is the job's (a joiner that differs in one is refused)
PER_MACHINE = frozenset({"nproc", "local_addr", "store_host", "rdzv_endpoint", "nnodes",
                         "max_restarts", "torchrun_args", "timeout", "out", "num_workers",
                         "print_every", "live", "tensorboard", "wandb", "charts", "peak_flops",
                         "profile"})


def defaults() -> TrainConfig:
    return TrainConfig()


# -- values ----------------------------------------------------------------------------------


# what torchtitan, HF Trainer and nanoGPT call some keys: suggested, never accepted silently
_OTHER_NAMES = {"learning_rate": "lr", "max_steps": "steps", "training_steps": "steps",
                "batch_size": "global_batch_size", "output_dir": "out", "dump_folder": "out",
                "num_layers": "n_layer", "warmup": "warmup_steps", "max_norm": "grad_clip",
                "max_grad_norm": "grad_clip", "seq_length": "seq_len", "block_size": "seq_len",
                "interval": "checkpoint_every", "save_steps": "checkpoint_every",
                "dataset": "data", "pipeline_parallel_degree": "stages",
                "data_parallel_degree": "data_parallel", "microbatch_size": "micro_batch_size"}


def _close(name: str, among: Any) -> str:
    near = [_OTHER_NAMES[name]] if name in _OTHER_NAMES and among is FIELDS else []
    near += difflib.get_close_matches(name, list(among), n=3 - len(near), cutoff=0.6)
    near += [k for k in among if name and name in k and k not in near][:3 - len(near)]
    return f" (did you mean {', '.join(near)}?)" if near else ""


def unknown_key(name: str, where: str) -> InputError:
    return InputError(f"{where}: unknown key {name!r}{_close(name, FIELDS)}; "
                      "`varuna-fx train --help` lists every key")


def convert(name: str, value: Any, where: str) -> Any:
    """``value`` (a string from a flag, or a TOML value) as key ``name`` takes it, checked."""
    meta = FIELDS[name].metadata
    kind: str = meta["kind"]
    base, _, auto = kind.partition("|")
    text = value if isinstance(value, str) else None
    takes = {"int": "an integer", "float": "a number", "bool": "true or false",
             "str": "a string", "path": "a path"}[base] + (" or auto" if auto else "")
    if auto and text is not None and text.strip().lower() == AUTO:
        return AUTO
    out: Any = None
    if base == "bool":
        if isinstance(value, bool):
            out = value
        elif text is not None and text.strip().lower() in ("true", "false", "1", "0", "yes",
                                                          "no", "on", "off"):
            out = text.strip().lower() in ("true", "1", "yes", "on")
    elif base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            out = value
        elif text is not None:
            try:
                out = int(text.replace("_", ""))
            except ValueError:
                out = None
    elif base == "float":
        if isinstance(value, int | float) and not isinstance(value, bool):
            out = float(value)
        elif text is not None:
            try:
                out = float(text)
            except ValueError:
                out = None
    elif text is not None:  # str, path
        out = text
    if out is None:
        raise InputError(f"{where}: {name} takes {takes}, got {value!r} ({meta['help']})")
    if base == "float" and not math.isfinite(out):
        # nan passes every bound (each comparison is false) and trains to NaN losses that
        # exit 0; inf is no rate, clip or size either
        raise InputError(f"{where}: {name} must be a finite number, got {out!r} "
                         f"({meta['help']})")
    if meta["choices"] and out not in meta["choices"]:
        raise InputError(f"{where}: {name} = {out!r} is not one of "
                         f"{', '.join(map(str, meta['choices']))}{_close(str(out), meta['choices'])}")
    low, high = meta["low"], meta["high"]
    if base in ("int", "float") and ((low is not None and out < low) or
                                     (high is not None and out > high)):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InputError(f"{where}: {name} must be {bounds}, got {out!r}")
    return out


# -- the file and the flags --------------------------------------------------------------------


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file's keys (flat), each checked: tables are the groups, nothing deeper."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"config file {path} does not exist (the first argument of "
                         "`varuna-fx train` is a .toml file; every other is a --key value)")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} is not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if isinstance(value, dict):
            if name not in GROUPS:
                raise InputError(f"{path}: unknown table [{name}]{_close(name, GROUPS)}; the "
                                 f"tables are {', '.join(GROUPS)} (or write keys at the top)")
            for inner, item in value.items():
                where = f"{path} [{name}]"
                if inner not in FIELDS:
                    raise unknown_key(inner, where)
                if FIELDS[inner].metadata["group"] != name:
                    raise InputError(f"{where}: {inner} belongs in "
                                     f"[{FIELDS[inner].metadata['group']}], not [{name}]")
                _put(values, inner, convert(inner, item, where), where)
        else:
            if name not in FIELDS:
                raise unknown_key(name, str(path))
            _put(values, name, convert(name, value, str(path)), str(path))
    return values


def _put(values: dict[str, Any], name: str, value: Any, where: str) -> None:
    if name in values:
        raise InputError(f"{where}: {name} is set twice")
    values[name] = value


def split_argv(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    """``[CONFIG.toml] --key value ...`` -> (the config file or None, the flags' values)."""
    config: str | None = None
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            if i == 1 and not token.startswith("-"):
                config = token
                continue
            raise InputError(f"unexpected argument {token!r}: a config file comes first, then "
                             "--key value pairs")
        name, eq, value = token[2:].partition("=")
        name = name.replace("-", "_")
        where = f"--{name.replace('_', '-')}"
        if name not in FIELDS:
            raise unknown_key(name, "command line")
        if not eq:
            nxt = argv[i] if i < len(argv) else None
            if FIELDS[name].metadata["kind"].startswith("bool") and \
                    (nxt is None or nxt.startswith("--")):
                value = "true"  # --elastic alone
            elif nxt is None:
                raise InputError(f"{where} needs a value ({FIELDS[name].metadata['help']})")
            else:
                value, i = nxt, i + 1
        if name in values:
            raise InputError(f"{where} is given twice")
        values[name] = convert(name, value, where)
    return config, values


def hf_config_path(model: str) -> Path:
    """A Hugging Face model's config.json: the path given, or the file in the folder given."""
    path = Path(model)
    return path / "config.json" if path.is_dir() else path


# -- writing it back ---------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def to_toml(cfg: TrainConfig, source: dict[str, str] | None = None) -> str:
    """The whole configuration as a TOML file ``read_toml`` reads back to ``cfg``, grouped in
    tables, each key with its meaning (and where it was set, when ``source`` says)."""
    lines: list[str] = []
    for group in GROUPS:
        lines += [""] * bool(lines) + [f"[{group}]"]
        for f in FIELDS.values():
            if f.metadata["group"] != group:
                continue
            note = f"  # {f.metadata['help']}"
            if source and f.name in source:
                note += f" [{source[f.name]}]"
            lines.append(f"{f.name} = {_toml_value(getattr(cfg, f.name))}{note}")
    return "\n".join(lines) + "\n"


def help_text() -> str:
    """``varuna-fx train --help``: usage and every key by group, with its default."""
    out = ["usage: varuna-fx train [CONFIG.toml] [--key value ...] [--print-config]",
           "",
           "Train a model from one command: every key below is a TOML key of CONFIG.toml (at",
           "the top level or under its [group]) and a flag (--global-batch-size 64); flags",
           "win. With no arguments: the built-in GPT on the Python standard library's sources,",
           "2 processes, about a minute. SIGTERM (or Ctrl-C) saves and exits 143 (130); the",
           "same command resumes from the newest checkpoint in --out, on any --nproc.",
           "--print-config shows the resolved configuration as TOML and exits."]
    for group in GROUPS:
        out += ["", f"[{group}]"]
        for f in FIELDS.values():
            if f.metadata["group"] == group:
                flag = f"--{f.name.replace('_', '-')} {_toml_value(f.default)}"
                out += textwrap.wrap(f.metadata["help"], width=_HELP_WIDTH,
                                     initial_indent=f"  {flag:<30}  ",
                                     subsequent_indent=" " * 34)
    return "\n".join(out)
