"""``varuna-fx train``'s configuration, in one process: the TOML file and the flags, every
refusal, the defaults as docs/API.md states them, and the pieces of the loop that need no
launch (the LR schedule, the built-in corpus, the model's vocabulary checks)."""

from __future__ import annotations

import math
import os
import re
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from varuna_fx.errors import CheckpointError, InputError
from varuna_fx.launch.train import train_command
from varuna_fx.runtime import preemption
from varuna_fx.train import worker as train_worker
from varuna_fx.train.checks import resolve
from varuna_fx.train.config import FIELDS, GROUPS, TrainConfig, _toml_value, read_toml, to_toml
from varuna_fx.train.data import BYTE_VOCAB, open_data, stdlib_corpus, stdlib_files
from varuna_fx.train.model import build_model
from varuna_fx.train.worker import Run, decode, lr_factor, save_on_ctrl_c

DOCS = Path(__file__).parents[2] / "docs" / "API.md"


def toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_no_arguments_resolve_to_the_documented_defaults() -> None:
    """Every key has a row in docs/API.md's table with its default as TOML writes it, and
    the defaults are the no-argument run the docs promise: the built-in GPT on the standard
    library's sources, 2 processes, checkpoints in runs/train."""
    cfg, source = resolve([])
    assert cfg == TrainConfig() and source == {}
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", DOCS.read_text(), re.M))
    assert set(FIELDS) <= set(rows), sorted(set(FIELDS) - set(rows))
    for name, f in FIELDS.items():
        assert rows[name] == _toml_value(f.default), name
    assert (cfg.model, cfg.data, cfg.nproc, cfg.out) == ("gpt", "stdlib", 2, "runs/train")
    assert cfg.compile_options()["stages"] is None  # auto: the planner's
    assert cfg.compile_options()["micro_batch_size"] is None  # auto: the planner's (issue 41)
    assert cfg.warmup == cfg.steps // 20


def test_the_file_its_tables_and_the_flags(tmp_path: Path) -> None:
    path = toml(tmp_path, 'steps = 50\nlr = 1e-3\n[compile]\nstages = 2\nrecompute = true\n'
                          '[data]\nseq_len = 32\n')
    cfg, source = resolve([path, "--lr", "2e-3", "--global-batch-size=32", "--elastic",
                           "--schedule", "1f1b", "--shuffle", "false", "--micro_batch_size", "4"])
    assert (cfg.steps, cfg.lr, cfg.stages, cfg.recompute, cfg.seq_len) == (50, 2e-3, 2, True, 32)
    assert (cfg.global_batch_size, cfg.elastic, cfg.schedule, cfg.shuffle) == (32, True, "1f1b",
                                                                                False)
    assert source["steps"] == "config file" and source["lr"] == "command line"
    assert cfg.compile_options()["micro_batch_size"] == 4
    assert resolve(["--stages", "auto"])[0].stages == "auto"


def test_print_config_reads_back_to_the_same_configuration(tmp_path: Path) -> None:
    cfg, source = resolve(["--steps", "7", "--out", 'a "b"', "--recompute", "false",
                           "--stages", "2", "--lr", "0.5"])
    text = to_toml(cfg, source)
    assert "[command line]" in text and all(f"[{g}]" in text for g in GROUPS)
    assert TrainConfig(**read_toml(toml(tmp_path, text))) == cfg


@pytest.mark.parametrize("argv, words", [
    (["--lrr", "1"], ["unknown key 'lrr'", "did you mean lr"]),
    (["--global-batch", "8"], ["unknown key", "global_batch_size"]),
    (["--max-steps", "8"], ["unknown key 'max_steps'", "did you mean steps"]),
    (["--steps"], ["--steps needs a value"]),
    (["--steps", "ten"], ["steps takes an integer", "'ten'"]),
    (["--steps", "0"], ["steps must be >= 1"]),
    (["--lr", "fast"], ["lr takes a number"]),
    (["--beta1", "1.5"], ["beta1 must be in [0.0, 1.0]"]),
    (["--lr", "nan"], ["lr must be a finite number, got nan"]),
    (["--lr", "inf"], ["lr must be a finite number, got inf"]),
    (["--grad-clip", "nan"], ["grad_clip must be a finite number", "0: off"]),
    (["--beta1", "nan"], ["beta1 must be a finite number"]),
    (["--shuffle", "maybe"], ["shuffle takes true or false"]),
    (["--recompute", "sometimes"], ["recompute takes true or false or auto"]),
    (["--schedule", "1f1"], ["schedule = '1f1' is not one of", "did you mean 1f1b"]),
    (["--precision", "fp8"], ["is not one of", "bf16"]),
    (["--steps", "3", "--steps", "4"], ["--steps is given twice"]),
    (["--steps", "3", "extra"], ["unexpected argument 'extra'"]),
    (["-s", "3"], ["unexpected argument '-s'"]),
    (["missing.toml"], ["config file missing.toml does not exist"]),
    (["--model", "mypkg.models:make", "--n-layer", "2"], ["n_layer size the built-in GPT"]),
    (["--model", "no_such_config.json"], ["neither gpt", "module:factory"]),
    (["--n-embd", "100", "--n-head", "3"], ["not a multiple of n_head"]),
    (["--data", "/no/such/file.bin"], ["is not a file", "stdlib"]),
    (["--warmup-steps", "50", "--steps", "10"], ["warmup_steps = 50 is longer than the run"]),
    (["--stop-at", "10", "--steps", "10"], ["not before the last step"]),
    (["--global-batch-size", "1", "--micro-batch-size", "auto"], ["at least 2 samples"]),
    (["--global-batch-size", "6", "--micro-batch-size", "4"],
     ["micro_batch_size = 4 does not divide global_batch_size = 6"]),
    (["--nnodes", "1:2"], ["nnodes belong to elastic = true", "torchrun_args"]),
    (["--in-place"], ["in_place belong to elastic = true", "--elastic --in-place"]),
    (["--elastic", "--in-place", "--torchrun-args=--nnodes=2"],
     ["torchrun_args do not go with in_place", "nnodes, rdzv_endpoint and local_addr"]),
    (["--store-host", "true"], ["store_host belongs to in_place = true"]),
    (["--nproc", "0"], ["nproc = 0", "--elastic --in-place"]),
    (["--elastic", "--in-place", "--nproc", "0", "--store-host", "false"],
     ["neither train nor host the membership store"]),
])
def test_every_refusal_of_the_command_line(argv: list[str], words: list[str]) -> None:
    with pytest.raises(InputError) as caught:
        resolve(argv)
    for word in words:
        assert word in str(caught.value), str(caught.value)


@pytest.mark.parametrize("text, words", [
    ("steps = \n", ["is not valid TOML"]),
    ("step = 3\n", ["unknown key 'step'", "did you mean steps"]),
    ("[optimiser]\nlr = 1\n", ["unknown table [optimiser]", "did you mean optimizer"]),
    ("[training]\nlr = 1e-3\n", ["lr belongs in [optimizer], not [training]"]),
    ("[training]\nsteps = 3\n[training.more]\nx = 1\n", ["unknown key 'more'"]),
    ("steps = 3\n[training]\nsteps = 4\n", ["steps is set twice"]),
    ("steps = 3.5\n", ["steps takes an integer", "3.5"]),
    ("elastic = 1\n", ["elastic takes true or false"]),
    ("stages = true\n", ["stages takes an integer or auto"]),
    ("model = 3\n", ["model takes a string"]),
    ("[launch]\nin_place = true\n", ["in_place belong to elastic = true"]),
    ("lr = nan\n", ["lr must be a finite number, got nan"]),
    ("[optimizer]\nweight_decay = inf\n", ["weight_decay must be a finite number"]),
])
def test_every_refusal_of_the_file(tmp_path: Path, text: str, words: list[str]) -> None:
    with pytest.raises(InputError) as caught:
        resolve([toml(tmp_path, text)])
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_init_from_needs_a_directory_or_file_that_exists(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        resolve(["--init-from", str(tmp_path / "nowhere")])


def test_the_command_says_what_is_wrong_without_launching(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    assert train_command(["--stepz", "3"]) == 2
    assert "unknown key 'stepz' (did you mean steps" in capsys.readouterr().err
    assert train_command(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"--{name.replace('_', '-')} " in out for name in FIELDS)
    assert train_command(["--steps", "9", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "steps = 9  #" in out and "[command line]" in out


def test_warmup_then_cosine_linear_or_constant() -> None:
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    f = lr_factor(cfg)
    assert [f(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert f(10) == 1.0 and math.isclose(f(55), 0.55) and math.isclose(f(100), 0.1)
    linear = lr_factor(TrainConfig(steps=100, warmup_steps=10, lr_schedule="linear"))
    assert math.isclose(linear(55), 0.55) and math.isclose(linear(100), 0.1)
    assert lr_factor(TrainConfig(steps=100, warmup_steps=0, lr_schedule="constant"))(70) == 1.0


def test_the_builtin_corpus_is_the_sorted_sources_cut_at_its_size(tmp_path: Path) -> None:
    for name, text in {"b.py": "bb", "a/z.py": "z", "a/b.py": "ab",
                       "site-packages/x.py": "xx", "c.txt": "no"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert [p.relative_to(tmp_path).as_posix() for p in stdlib_files(tmp_path)] == \
        ["a/b.py", "a/z.py", "b.py"]
    assert stdlib_corpus(100, tmp_path).tobytes() == b"ab\nz\nbb\n"
    assert stdlib_corpus(4, tmp_path).tobytes() == b"ab\nz"
    real = stdlib_corpus(50_000)
    assert len(real) == 50_000 and np.array_equal(real, stdlib_corpus(50_000))


def test_the_models_vocabulary_must_cover_the_data(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    cfg = TrainConfig(data=str(text), seq_len=8, n_layer=1, n_embd=16, n_head=2)
    data = open_data(cfg)
    assert data.vocab_size == BYTE_VOCAB and data.largest_token == ord("w")
    assert build_model(cfg, data.vocab_size, data.largest_token,
                       initialise=True).vocab_size == BYTE_VOCAB
    with pytest.raises(InputError, match="token id 119, but the model's vocabulary has 100"):
        build_model(TrainConfig(**{**cfg.__dict__, "vocab_size": 100}), data.vocab_size,
                    data.largest_token, initialise=True)
    tokens = tmp_path / "t.bin"
    np.arange(600, dtype=np.uint16).tofile(tokens)
    binary = TrainConfig(data=str(tokens), seq_len=8, n_layer=1, n_embd=16, n_head=2)
    data = open_data(binary)
    assert data.vocab_size is None and data.largest_token == 599
    with pytest.raises(InputError, match="give the tokenizer's"):
        build_model(binary, data.vocab_size, data.largest_token, initialise=True)
    with pytest.raises(InputError, match="no module named 'no_such_module_x'"):
        build_model(TrainConfig(model="no_such_module_x:make"), None, 0, initialise=True)


def test_a_folder_holding_another_models_run_is_refused_saying_what_to_do(
        tmp_path: Path) -> None:
    tiny = dict(n_embd=16, n_head=2, seq_len=8, corpus_bytes=4096, out=str(tmp_path / "run"))
    run = Run(TrainConfig(n_layer=1, **tiny), None)
    pipe, opt, sched, loader, progress = run.build()
    assert progress.step == 0
    run.save(pipe, opt, sched, loader, 3)
    with pytest.raises(CheckpointError, match="cannot resume .* give another --out"):
        Run(TrainConfig(n_layer=2, **tiny), None).build()


def test_ctrl_c_stops_as_sigterm_does_and_a_second_one_interrupts() -> None:
    """(The handlers of this test process are put back afterwards.)"""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        preemption.clear()
        preemption.install_handlers()
        save_on_ctrl_c()
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.requested()  # every rank saves after this step
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        preemption.clear()
        train_worker._INTERRUPTED.clear()


def test_the_command_starts_the_worker_module_under_torchrun_with_the_checked_config(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What ``varuna-fx train --nproc 3`` hands torchrun, read by torchrun's own parser (its
    ``run`` replaced): the worker as a module on 3 local ranks, the rendezvous on 127.0.0.1,
    the configuration as the one argument; elastic and multi-machine settings pass through."""
    import torch.distributed.run

    calls: list[Any] = []
    monkeypatch.setattr(torch.distributed.run, "run", calls.append)
    out = str(tmp_path / "run")
    assert train_command(["--nproc", "3", "--steps", "7", "--out", out]) == 0
    parsed = calls[0]
    assert parsed.module and parsed.training_script == "varuna_fx.train.worker"
    assert parsed.nproc_per_node == "3" and parsed.rdzv_endpoint == "127.0.0.1:0"
    cfg, launched_at, _ = decode(*parsed.training_script_args)
    assert cfg == TrainConfig(nproc=3, steps=7, out=out) and launched_at > 0
    assert train_command(["--nproc", "2", "--elastic", "--nnodes", "1:3", "--rdzv-endpoint",
                          "10.0.0.1:29400", "--out", out]) == 0
    assert (calls[1].nnodes, calls[1].rdzv_endpoint) == ("1:3", "10.0.0.1:29400")
    assert train_command(["--torchrun-args", "--nnodes=2 --node-rank=1 --rdzv-endpoint=h:1",
                          "--out", out]) == 0
    assert (calls[2].nnodes, calls[2].node_rank, calls[2].standalone) == ("2", 1, False)


def test_in_place_starts_the_in_place_launcher_with_the_checked_config(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--elastic --in-place`` (or ``in_place = true`` under ``[launch]``) hands the worker
    module and the configuration to varuna_fx's in-place launcher (its ``run`` replaced), with
    the machine's settings; its exit status says how the job ended."""
    from varuna_fx.launch.in_place import InPlaceLaunch

    launches: list[InPlaceLaunch] = []
    status = [0]

    def run(launch: InPlaceLaunch) -> int:
        launches.append(launch)
        return status[0]

    monkeypatch.setattr(InPlaceLaunch, "run", run)
    out = str(tmp_path / "run")
    job = toml(tmp_path, "[launch]\nelastic = true\nin_place = true\nnproc = 3\n")
    assert train_command([job, "--steps", "7", "--out", out]) == 0
    launch = launches[0]
    assert (launch.nproc, launch.min_world, launch.store_host) == (3, 3, True)
    assert launch.argv[:2] == ["-m", "varuna_fx.train.worker"]
    cfg, _, source = decode(launch.argv[2])
    assert cfg == TrainConfig(elastic=True, in_place=True, nproc=3, steps=7, out=out)
    assert source["in_place"] == "config file"
    flags = ["--elastic", "--in-place", "--nnodes", "1:4", "--nproc", "0", "--store-host",
             "--rdzv-endpoint", "10.0.0.1:29400", "--local-addr", "10.0.0.2", "--out", out]
    assert train_command(flags) == 0
    assert (launches[1].nproc, launches[1].store_host, launches[1].max_world) == (0, True, 4)
    status[0] = 128 + signal.SIGTERM  # a signal to the launcher, passed on: saved and stopped
    assert train_command([job, "--out", out]) == 143
    status[0] = 1  # a worker failed past --max-restarts
    assert train_command([job, "--out", out]) == 1


def test_negative_token_ids_in_the_data_are_refused_before_training(tmp_path: Path) -> None:
    """(issue 42, item 6) as too-large ids are: a Megatron int32 file holding -1 is refused
    when the command opens the data, not by the embedding mid-step."""
    import struct

    tokens = np.arange(600, dtype=np.int32) % 90
    tokens[300] = -1
    tokens.tofile(tmp_path / "t.bin")
    with open(tmp_path / "t.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4))
    with pytest.raises(InputError, match=r"t.bin holds the negative token id -1 at position 300"):
        open_data(TrainConfig(data=str(tmp_path / "t.bin"), seq_len=8, vocab_size=100))


def test_out_and_export_that_are_files_are_refused_before_anything_runs(
        tmp_path: Path) -> None:
    """(issue 42, item 7) --out onto a file failed with a raw FileExistsError after compile,
    --export onto a file only after the whole run: both are refused by the checks, as is a
    path under a file."""
    (tmp_path / "f").write_text("x")
    for argv, words in [(["--out", str(tmp_path / "f")], ["out = ", "is a file", "folder"]),
                        (["--out", str(tmp_path / "f" / "run")], ["out = ", "is under",
                                                                  "a file"]),
                        (["--export", str(tmp_path / "f")], ["export = ", "is a file",
                                                             "directory"])]:
        with pytest.raises(InputError) as caught:
            resolve(argv)
        for word in words:
            assert word in str(caught.value), str(caught.value)
    assert resolve(["--out", str(tmp_path / "new" / "run"),
                    "--export", str(tmp_path / "hf")])[0].out == str(tmp_path / "new" / "run")
