"""``varuna-fx train``'s configuration resolved and checked: the file and the flags read into a
:class:`~.config.TrainConfig` (flags winning), then every rule between keys checked before a
process is launched -- the data and tokenizer, the batch equation, validation, in-place
jobs -- each refusal saying what to change. The keys themselves are ``config.py``'s."""

from __future__ import annotations

import math
from pathlib import Path

from ..data.documents import TEXT_SUFFIXES, is_document_source, is_saved_dataset
from ..data.tokens import TOKEN_SUFFIXES
from ..errors import InputError
from .config import (
    AUTO,
    BUILTIN_GPT,
    GPT_KEYS,
    STDLIB_CORPUS,
    TrainConfig,
    hf_config_path,
    read_toml,
    split_argv,
)


def resolve(argv: list[str]) -> tuple[TrainConfig, dict[str, str]]:
    """The run's configuration from the command line, and where each key set came from
    ("config file" or "command line"; keys left at their default are absent)."""
    config, flags = split_argv(list(argv))
    from_file = read_toml(config) if config is not None else {}
    source = {k: "config file" for k in from_file} | {k: "command line" for k in flags}
    given = from_file | flags
    cfg = TrainConfig(**given)
    check(cfg, set(source))
    return cfg, source


def check(cfg: TrainConfig, given: set[str]) -> None:
    """What no single value shows: keys that go together, paths that must exist."""
    if cfg.model != BUILTIN_GPT:
        is_factory = ":" in cfg.model and not Path(cfg.model).exists()
        # (a factory is offered vocab_size, as it is seq_len: docs/API.md)
        stray = [k for k in GPT_KEYS if k in given and not (is_factory and k == "vocab_size")]
        if stray:
            raise InputError(f"{', '.join(stray)} size the built-in GPT, but model = "
                             f"{cfg.model!r} brings its own sizes: remove them")
        if not is_factory and not hf_config_path(cfg.model).is_file():
            raise InputError(f"model = {cfg.model!r}: neither gpt, a Hugging Face config.json "
                             "(or a directory holding one), nor module:factory")
    elif cfg.n_embd % cfg.n_head:
        raise InputError(f"n_embd = {cfg.n_embd} is not a multiple of n_head = {cfg.n_head}")
    if cfg.data != STDLIB_CORPUS and not Path(cfg.data).is_file() and \
            not (Path(cfg.data).is_dir() and is_saved_dataset(Path(cfg.data))):
        raise InputError(f"data = {cfg.data!r} is not a file (give a token .bin file, a text "
                         "or .jsonl file with --tokenizer, a datasets save_to_disk folder, or "
                         "stdlib for the built-in corpus)")
    _check_tokenizer(cfg)
    _check_folder("out", cfg.out, "the run's folder")
    if cfg.export:
        _check_folder("export", cfg.export, "the directory the model is exported to")
    if cfg.init_from and not Path(cfg.init_from).exists():
        raise InputError(f"init_from = {cfg.init_from!r} does not exist")
    check_eval(cfg)
    if cfg.warmup_steps != AUTO and cfg.warmup_steps > cfg.steps:
        raise InputError(f"warmup_steps = {cfg.warmup_steps} is longer than the run (steps = "
                         f"{cfg.steps})")
    if cfg.stop_at and cfg.stop_at >= cfg.steps:
        raise InputError(f"stop_at = {cfg.stop_at} is not before the last step (steps = "
                         f"{cfg.steps}): leave it out to run to the end")
    if cfg.micro_batch_size != AUTO and cfg.global_batch_size % cfg.micro_batch_size:
        raise InputError(f"micro_batch_size = {cfg.micro_batch_size} does not divide "
                         f"global_batch_size = {cfg.global_batch_size}: change one, or let "
                         "the planner choose (micro_batch_size = \"auto\")")
    _check_batch_equation(cfg)
    if cfg.global_batch_size == 1:
        raise InputError("global_batch_size = 1: a pipeline needs at least 2 samples per step")
    elastic_only = [k for k in ("nnodes", "rdzv_endpoint", "local_addr", "in_place")
                    if getattr(cfg, k)]
    if elastic_only and not cfg.elastic:
        raise InputError(f"{', '.join(elastic_only)} belong to elastic = true (in_place: "
                         "--elastic --in-place, as `varuna-fx run`); for a fixed multi-machine "
                         "job pass torchrun's flags in torchrun_args")
    check_in_place(cfg)


def _check_tokenizer(cfg: TrainConfig) -> None:
    """Documents need a tokenizer (text alone is read as bytes); tokens need none."""
    if cfg.tokenizer:
        if not Path(cfg.tokenizer).is_dir():
            raise InputError(f"tokenizer = {cfg.tokenizer!r} is not a folder: give the local "
                             "folder holding tokenizer.json (nothing is downloaded)")
        if cfg.data == STDLIB_CORPUS or Path(cfg.data).suffix in TOKEN_SUFFIXES:
            raise InputError(f"tokenizer = {cfg.tokenizer!r} with data = {cfg.data!r}, which "
                             "is already tokens (bytes or a .bin file): give a .txt or .jsonl "
                             "file, or remove --tokenizer")
    elif cfg.data != STDLIB_CORPUS and is_document_source(cfg.data) and \
            Path(cfg.data).suffix not in TEXT_SUFFIXES:
        raise InputError(f"data = {cfg.data!r} holds documents to tokenize: give the tokenizer's "
                         "local folder with --tokenizer DIR")


def _check_batch_equation(cfg: TrainConfig) -> None:
    """global_batch_size = micro_batch_size x grad_accum_steps x data_parallel, for the
    values given (the planner chooses the others so that it holds)."""
    if cfg.grad_accum_steps == AUTO:
        return
    terms = {k: getattr(cfg, k) for k in ("micro_batch_size", "grad_accum_steps",
                                          "data_parallel") if getattr(cfg, k) != AUTO}
    product = math.prod(terms.values())
    shown = " x ".join(f"{k} = {v}" for k, v in terms.items())
    if len(terms) == 3 and product != cfg.global_batch_size:
        raise InputError(f"{shown} is a global batch of {product}, not global_batch_size = "
                         f"{cfg.global_batch_size}: change one, or set micro_batch_size or "
                         "data_parallel to auto")
    if cfg.global_batch_size % product:
        raise InputError(f"{shown} does not divide global_batch_size = "
                         f"{cfg.global_batch_size} (global batch = micro-batch x "
                         "grad_accum_steps x replicas): change one of them")


def check_eval(cfg: TrainConfig) -> None:
    """Validation's keys go together: held-out data and how often."""
    held = [k for k in ("eval_data", "eval_fraction") if getattr(cfg, k)]
    if len(held) == 2:
        raise InputError("eval_data and eval_fraction both name the held-out data: give one "
                         "(a file of its own, or a fraction of data)")
    if cfg.eval_every and not held:
        raise InputError(f"eval_every = {cfg.eval_every} needs held-out data: give eval_data "
                         "= FILE, or eval_fraction = 0.05 (the end of data, never trained on)")
    if held and not cfg.eval_every:
        raise InputError(f"{held[0]} is held out for validation, but eval_every = 0: give "
                         "--eval-every N (validate every N steps)")
    if cfg.keep_best and not cfg.eval_every:
        raise InputError("keep_best keeps the checkpoint of the lowest validation loss: give "
                         "--eval-every N and held-out data (eval_data or eval_fraction)")
    if cfg.eval_data and not Path(cfg.eval_data).is_file():
        raise InputError(f"eval_data = {cfg.eval_data!r} is not a file (give a token .bin file "
                         "or a text file, as data takes them)")


def _check_folder(name: str, value: str, what: str) -> None:
    """A folder the run creates or writes into must not be a file, nor under one (found only
    after compile, or after the whole run for ``export``, otherwise)."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise InputError(f"{name} = {value!r} is a file; {name} is {what}, a directory "
                         "(created when missing): give another path")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"{name} = {value!r} is under {str(parent)!r}, which is a "
                                 f"file; {name} is {what}, a directory: give another path")
            break


def check_in_place(cfg: TrainConfig) -> None:
    """What in-place morphing does not go with, refused before anything is launched."""
    if not cfg.in_place:
        if cfg.store_host != AUTO:
            raise InputError("store_host belongs to in_place = true (the membership store of "
                             "an in-place job): remove it, or add --in-place")
        if cfg.nproc == 0:
            raise InputError("nproc = 0 (a machine running no training process) only hosts "
                             "the membership store of an in-place job: give --nproc 1 or more, "
                             "or add --elastic --in-place")
        return
    if cfg.torchrun_args:
        raise InputError(
            "torchrun_args do not go with in_place = true: an in-place job is started by "
            "varuna_fx's own launcher, not torchrun; describe the machines with nnodes, "
            "rdzv_endpoint and local_addr, or remove in_place for torchrun's restart path")
    if cfg.nproc == 0 and cfg.store_host is False:
        raise InputError(
            "nproc = 0 with store_host = false: this machine would neither train nor host the "
            "membership store; give --nproc 1 or more, or --store-host true")


