"""varuna-fx: train, inspect a model's partition and stage code, plan for a cluster, launch,
demo. (``train`` parses its own flags: launch/train.py.)

Output is for people on a terminal and for logs elsewhere: when stdout is not a terminal nothing
is wrapped or coloured, so table headers stay whole and stage code copied from a log is valid
Python. "plan --json" and "inspect --json" print machine-readable results instead.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.syntax import Syntax

import varuna_fx as vf
from varuna_fx.examples import demo_gpt, lm_loss
from varuna_fx.launch.plan_command import plan_as_dict, plan_command
from varuna_fx.launch.torchrun import Ranks, start_ranks
from varuna_fx.launch.train import train_command
from varuna_fx.monitor.report import add_report_command
from varuna_fx.schedule import DEFAULT_SCHEDULE, schedule_choices
from varuna_fx.train.factory import load_factory
from varuna_fx.world.launch_options import AUTO, LAUNCH_OPTIONS

_load_factory = load_factory  # its home is train/factory.py (launch/plan_command.py uses it too)

# wide enough that rich never wraps a table or a line of generated code in a log file
_PLAIN_WIDTH = 10_000


def output_console() -> Console:
    """A rich console for stdout: the usual one on a terminal, else plain and unwrapped."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=_PLAIN_WIDTH, soft_wrap=True, color_system=None, highlight=False,
                   emoji=False)


def print_code(console: Console, code: str) -> None:
    """Highlighted on a terminal; verbatim otherwise (so it can be copied and run)."""
    if console.is_terminal:
        console.print(Syntax(code, "python", word_wrap=True))
    else:
        console.out(code, highlight=False)


def cmd_demo(args: argparse.Namespace) -> int:
    console = output_console()
    model, tokens, targets = demo_gpt(n_layer=args.layers)
    pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=args.stages,
                      schedule=args.schedule, tracer=args.tracer,
                      stages_per_rank=None)  # the schedule's default
    console.print(pipe.plan)
    stage = pipe.stages[min(args.show_stage, len(pipe.stages) - 1)]
    console.print(f"\n[bold]Generated code of stage {stage.index}[/bold]")
    print_code(console, stage.code)
    loss = float(pipe.step(tokens, target=targets))
    vocab = model.cfg.vocab_size
    console.print(f"\none training step under the {pipe.plan.schedule.name} schedule: loss {loss:.4f} "
                  f"(an untrained model over {vocab} tokens starts near ln({vocab}) = "
                  f"{math.log(vocab):.2f})")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    console = output_console()
    made = _load_factory(args.model)()
    model, inputs = made[0], made[1]
    pipe = vf.compile(model, example_inputs=inputs, stages=args.stages, tracer=args.tracer)
    shown = [s for s in pipe.stages if args.stage is None or s.index == args.stage]
    written: list[Path] = []
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for stage in pipe.stages:
            path = out / f"stage{stage.index}.py"
            path.write_text(stage.code)
            written.append(path)
    if args.json:
        result = plan_as_dict(pipe.plan)
        result["stage_code"] = [
            {"index": s.index, "parameter_names": list(s.parameter_names), "code": s.code}
            for s in shown]
        result["written"] = [str(p) for p in written]
        print(json.dumps(result, indent=2))
        return 0
    console.print(pipe.plan)
    if written:
        console.print(f"wrote the code of {len(written)} stages to {args.out}: "
                      + ", ".join(p.name for p in written))
        return 0
    for stage in shown:
        print_code(console, stage.code)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    return plan_command(args, output_console())


def split_at_script(argv: list[str], run: argparse.ArgumentParser
                    ) -> tuple[list[str], list[str]]:
    """``run``'s own words (up to and including the script) and the script's arguments.

    Everything after the script is the script's, untouched: neither argparse (which would read
    ``--log`` as an abbreviation of an option, or say it is ambiguous) nor torchrun (whose parser
    raises "ambiguous option: --log could match --log-dir, ..." even after the script) sees
    it. ``--`` before the script is accepted and dropped. The value that follows
    ``--torchrun-args`` is glued to it (``--torchrun-args=--nnodes=2``): argparse reads a value
    that starts with '-' as an option, here even inside a quoted "--nnodes=2 --node-rank=0"."""
    if not argv or argv[0] != "run":
        return argv, []
    takes_value = {o for a in run._actions if a.nargs != 0 for o in a.option_strings}
    out, i = argv[:1], 1
    while i < len(argv):
        token = argv[i]
        if token == "--torchrun-args" and i + 1 < len(argv):
            out.append(f"{token}={argv[i + 1]}")
            i += 2
        elif token in takes_value:
            out += argv[i:i + 2]
            i += 2
        elif token == "--":  # the script follows
            return out + argv[i + 1:i + 2], argv[i + 2:]
        elif token.startswith("-"):
            out.append(token)
            i += 1
        else:  # the script: the rest is not ours to read
            return out + [token], argv[i + 1:]
    return out, []


def cmd_run(args: argparse.Namespace) -> int:
    """Run the script under torchrun (launch/torchrun.py): standalone on one machine,
    multi-node flags pass through; ``--elastic``: torchrun's elastic agent set up for
    morphing (launch/elastic.py); ``--elastic --in-place``: varuna_fx's in-place launcher
    (launch/in_place.py)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    ranks = ranks_of_args(args)
    try:
        return start_ranks(ranks, args.script, args.script_args)
    except SignalException as stop:
        # what a spot supervisor sends: torchrun passed it on to the workers (which save and
        # exit, see pipe.preempted) and then raised; a traceback and exit code 1 read as a
        # crash, so say what happened and exit as a process the signal ended does
        name = signal.Signals(stop.sigval).name
        print(f"varuna-fx run: stopped by {name}; the workers were sent {name} too (a "
              "preemption-safe loop saves a checkpoint and exits)", file=sys.stderr)
        return 128 + int(stop.sigval)


def ranks_of_args(args: argparse.Namespace) -> Ranks:
    """Where ``varuna-fx run``'s ranks run, from its parsed flags, checked (the elastic flags go
    with --elastic, --in-place with both); docs/multi_node.md's commands are read through it."""
    if not args.elastic and (args.nnodes or args.rdzv_endpoint or args.local_addr):
        raise SystemExit("--nnodes / --rdzv-endpoint / --local-addr belong to --elastic; for "
                         "a fixed multi-machine job pass torchrun's flags in --torchrun-args")
    in_place = getattr(args, "in_place", False)  # (a Namespace made by another caller)
    if in_place and not args.elastic:
        raise SystemExit("--in-place goes with --elastic")
    return Ranks.of(vars(args))  # the launch options, by their names


def _setting(text: str) -> bool | str:
    """auto | true | false (as compile's recompute= and shard_optimizer= take them)."""
    value = {"auto": "auto", "true": True, "false": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r}: choose auto, true or false")
    return value


def _stages_per_rank(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive number of stages, or auto")
    return int(text)


_TRACER_HELP = ("how to capture the model: fx (torch.fx symbolic tracing), export "
                "(torch.export), auto (fx, then export if fx fails; default)")
_SCHEDULE_HELP = (f"micro-batch schedule: {' | '.join(schedule_choices())} (auto: the planner "
                  "picks the fastest that fits; default: %(default)s)")
_FACTORY_HELP = ("module:function that returns (model, example_inputs[, ...]), e.g. "
                 "mypkg.models:make_gpt; example_inputs is a tuple of positional or a dict of "
                 "keyword arguments, dim 0 the batch")


def add_launch_options(run: argparse.ArgumentParser) -> None:
    """``run``'s launch flags, each from its one declaration (world/launch_options.py): the
    same names and help as ``varuna-fx train``'s ``[launch]`` keys. ``--nproc`` is required
    here (a script has no default size); the strings are unset (None) by default."""
    for option in LAUNCH_OPTIONS:
        if not option.run:
            continue
        if option.name == "torchrun_args":
            run.add_argument(option.flag, action="append", default=[], metavar='"FLAGS"',
                             help=option.help)
        elif option.kind.startswith("bool"):  # (store_host: None, not False, when not given)
            run.add_argument(option.flag, action="store_true",
                             default=None if option.kind.endswith(AUTO) else False,
                             help=option.help)
        elif option.name == "nproc":
            run.add_argument(option.flag, type=int, required=True, help=option.help)
        elif option.kind == "int":
            run.add_argument(option.flag, type=int, default=option.default,
                             help=option.help)
        else:
            run.add_argument(option.flag, default=option.default or None, help=option.help)


# the top-level --help: what a user reads (the module docstring is for the code's readers)
_DESCRIPTION = """\
Train a model, inspect its partition and stage code, plan it for a cluster, launch a training
script on several processes, or run a demo. `varuna-fx COMMAND --help` lists a command's
options.

On a terminal output is wrapped and coloured; in a log it is plain and unwrapped (stage code
copied from a log is valid Python). plan --json and inspect --json print JSON."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="varuna-fx", description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # listed here for --help; main() hands its arguments to launch/train.py unparsed
    sub.add_parser("train", add_help=False,
                   help="train a model from a TOML config and --key value flags (no arguments: "
                        "the built-in GPT on the standard library's sources, 2 processes, "
                        "about a minute); varuna-fx train --help lists every key")

    demo = sub.add_parser(
        "demo", help="compile the built-in GPT, print its plan and a stage, run one step",
        description="Compile the built-in GPT (1000-token vocabulary, 64-dim embeddings) on "
                    "this machine, print its partition table and one stage's generated code, "
                    "then run one training step and print its loss.")
    demo.add_argument("--layers", type=int, default=8,
                      help="transformer blocks in the demo GPT (default: %(default)s)")
    demo.add_argument("--stages", type=int, default=4,
                      help="pipeline stages P to cut it into (default: %(default)s)")
    demo.add_argument("--schedule", default=DEFAULT_SCHEDULE, choices=schedule_choices(),
                      help=_SCHEDULE_HELP)
    demo.add_argument("--tracer", default="auto", choices=["auto", "fx", "export"],
                      help=_TRACER_HELP)
    demo.add_argument("--show-stage", type=int, default=1,
                      help="which stage's code to print (default: %(default)s)")
    demo.set_defaults(func=cmd_demo)

    inspect = sub.add_parser(
        "inspect", help="partition a model in one process and print its plan and stage code",
        description="Compile a model from a factory function in this process and print the "
                    "partition table and the generated code of its stages.")
    inspect.add_argument("--model", required=True, help=_FACTORY_HELP)
    inspect.add_argument("--stages", type=int, default=2,
                         help="pipeline stages P (default: %(default)s)")
    inspect.add_argument("--stage", type=int, default=None,
                         help="print only this stage's code (default: every stage)")
    inspect.add_argument("--out", default=None, metavar="DIR",
                         help="write each stage's code to DIR/stage<i>.py instead of printing it")
    inspect.add_argument("--json", action="store_true",
                         help="print the plan and the stage code as JSON")
    inspect.add_argument("--tracer", default="auto", choices=["auto", "fx", "export"],
                         help=_TRACER_HELP)
    inspect.set_defaults(func=cmd_inspect)

    plan = sub.add_parser(
        "plan", help="choose stages P, replicas D and micro-batch size for a described cluster",
        description="Plan a model for a cluster you describe (it need not exist here): search "
                    "P x D x micro-batch size, simulate the best, print the choice, the "
                    "alternatives and the chosen configuration's stages.")
    plan.add_argument("--model", default="varuna_fx.examples:demo_gpt",
                      help=_FACTORY_HELP + " (default: the demo GPT, batch 8)")
    plan.add_argument("--gpus", type=int, default=16,
                      help="devices in the whole job (default: %(default)s)")
    plan.add_argument("--gpus-per-node", type=int, default=4,
                      help="devices per machine (default: %(default)s)")
    plan.add_argument("--gpu-memory", default="16GiB",
                      help="memory per device, e.g. 16GiB, 32GB (default: %(default)s)")
    plan.add_argument("--intra-node-bandwidth", default="100GB/s",
                      help="between devices of one machine, e.g. 100GB/s (default: %(default)s)")
    plan.add_argument("--inter-node-bandwidth", default="10Gbit/s",
                      help="between machines, e.g. 10Gbit/s (default: %(default)s)")
    plan.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                      help="device kind of the cluster (default: %(default)s)")
    plan.add_argument("--global-batch-size", type=int, default=None,
                      help="samples per optimizer step over all replicas (default: each replica "
                           "takes the factory's example batch, so the global batch grows with D)")
    plan.add_argument("--schedule", default=DEFAULT_SCHEDULE, choices=schedule_choices(),
                      help=_SCHEDULE_HELP + "; one of several stages per rank is planned as "
                      "compile plans it: v stages on each device of one replica")
    plan.add_argument("--device-type", default=None,
                      help="a100 | v100 | h100 | h200 | cpu: the device to time with FLOPs")
    plan.add_argument("--flops", default=None, help="sustained throughput, e.g. 150TFLOP/s")
    plan.add_argument("--latency", default="0",
                      help="per message between devices, e.g. 5us (default: %(default)s)")
    plan.add_argument("--stages", type=int, default=None, help="fix P (default: searched)")
    plan.add_argument("--data-parallel", type=int, default=None,
                      help="fix D (default: searched)")
    plan.add_argument("--micro-batch-size", type=int, default=None,
                      help="fix the micro-batch size (default: searched)")
    plan.add_argument("--grad-accum-steps", type=int, default=None,
                      help="fix the micro-batches per replica per step (gradient accumulation): "
                           "global batch = micro-batch x micro-batches x replicas (default: "
                           "searched)")
    plan.add_argument("--stages-per-rank", default=None, type=_stages_per_rank,
                      metavar="V|auto",
                      help="model stages on each device, as compile's stages_per_rank (several: "
                           "--schedule interleaved-1f1b, zbv or dualpipev); auto: the "
                           "schedule's own, and with --schedule auto the planner weighs virtual "
                           "stages too (default: 1, or 2 for interleaved-1f1b, zbv and "
                           "dualpipev)")
    plan.add_argument("--recompute", default="auto", type=_setting, metavar="auto|true|false",
                      help="recompute activations in the backward, as compile's recompute: "
                           "auto plans without it unless nothing fits (default: %(default)s)")
    plan.add_argument("--no-recompute", action="store_true", help="the same as --recompute false")
    plan.add_argument("--shard-optimizer", default="auto", type=_setting,
                      metavar="auto|true|false",
                      help="ZeRO-1 over each stage's replicas, as compile's shard_optimizer: "
                           "auto shards an optimizer built with pipe.optimizer when D > 1 and "
                           "counts it sharded only where a configuration needs it to fit "
                           "(default: %(default)s)")
    plan.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                      help="as compile's precision; the plan is the same for each (the planner "
                           "prices the model's own dtypes) (default: %(default)s)")
    plan.add_argument("--profile", action="store_true",
                      help="measure this device (cached) instead of FLOP estimates")
    plan.add_argument("--top", type=int, default=5,
                      help="configurations to show (default: %(default)s)")
    plan.add_argument("--json", action="store_true",
                      help="print the choice, the alternatives and the stages as JSON")
    plan.add_argument("--tracer", default="auto", choices=["auto", "fx", "export"],
                      help=_TRACER_HELP)
    plan.set_defaults(func=cmd_plan)

    run = sub.add_parser(
        "run", help="launch a training script on local processes (torchrun)",
        allow_abbrev=False,  # an abbreviation would be read up to the script: spell options out
        description="Run SCRIPT under torchrun: --standalone on this machine unless "
                    "--torchrun-args names --nnodes or --rdzv flags. A multi-machine job: "
                    "varuna-fx run --nproc 4 --torchrun-args=\"--nnodes=2 --node-rank=0 "
                    "--rdzv-endpoint=host:29400\" train.py --lr 1e-3")
    add_launch_options(run)
    run.add_argument("script", help="the training script every process runs")
    run.add_argument("script_args", nargs=argparse.REMAINDER,
                     help="arguments passed on to the script untouched (--log, --node, "
                          "--help ... after the script are the script's)")
    run.set_defaults(func=cmd_run)

    add_report_command(sub)  # varuna-fx report RUN_DIR: monitor/report.py
    return parser


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # every key of its config is a flag: launch/train.py parses them
        return train_command(argv[1:])
    parser = build_parser()
    argv, script_args = split_at_script(argv, _subcommand(parser, "run"))
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "func", None) is cmd_run:
        args.script_args = script_args  # (argparse never saw them)
    if unknown:
        hint = ""
        if getattr(args, "func", None) is cmd_run:
            hint = (" (several torchrun flags go in one quoted string: "
                    '--torchrun-args="--nnodes=2 --node-rank=0")')
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    try:
        return int(args.func(args) or 0)
    except vf.VarunaFxError as exc:  # the user's input: say what to change, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
