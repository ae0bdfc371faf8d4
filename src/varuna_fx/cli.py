"""``varuna-fx``: inspect a model's partition and stage code, plan, launch, demo."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from contextlib import nullcontext

from rich.console import Console
from rich.syntax import Syntax

import varuna_fx as vf
from varuna_fx.elastic import elastic_launch
from varuna_fx.examples import demo_gpt, lm_loss
from varuna_fx.factory import load_factory
from varuna_fx.planner.report import plan_command
from varuna_fx.runtime.standalone import loopback_stores, standalone_args

_load_factory = load_factory  # its home is factory.py (planner/report.py uses it too)


def cmd_demo(args: argparse.Namespace) -> int:
    console = Console()
    model, tokens, targets = demo_gpt(n_layer=args.layers)
    pipe = vf.compile(model, example_inputs=(tokens,), loss_fn=lm_loss, stages=args.stages,
                      schedule=args.schedule, tracer=args.tracer)
    console.print(pipe.plan)
    stage = pipe.stages[min(args.show_stage, len(pipe.stages) - 1)]
    console.print(f"\n[bold]Generated code of stage {stage.index}[/bold]")
    console.print(Syntax(stage.code, "python", word_wrap=True))
    loss = pipe.step(tokens, target=targets)
    console.print(f"\none training step under the {args.schedule} schedule: loss {float(loss):.4f}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    console = Console()
    made = _load_factory(args.model)()
    model, inputs = made[0], made[1]
    pipe = vf.compile(model, example_inputs=inputs, stages=args.stages, tracer=args.tracer)
    console.print(pipe.plan)
    for stage in pipe.stages:
        if args.stage is None or stage.index == args.stage:
            console.print(Syntax(stage.code, "python", word_wrap=True))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    return plan_command(args)


def cmd_run(args: argparse.Namespace) -> int:
    """Wrap torch.distributed.run: standalone on one machine, multi-node flags pass through;
    ``--elastic``: torchrun's elastic agent set up for morphing (varuna_fx.elastic)."""
    from torch.distributed.run import main as torchrun

    argv = list(args.torchrun_args)
    if args.elastic:
        launch = elastic_launch(
            nproc=args.nproc, nnodes=args.nnodes or "1:1", rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=args.rdzv_id, local_addr=args.local_addr, max_restarts=args.max_restarts,
            rdzv_conf=args.rdzv_conf)
        os.environ.update(launch.env)  # read by torchrun's rendezvous and inherited by workers
        torchrun([*launch.argv, *argv, args.script, *args.script_args])
        return 0
    if args.nnodes or args.rdzv_endpoint or args.local_addr:
        raise SystemExit("--nnodes / --rdzv-endpoint / --local-addr belong to --elastic; for a "
                         "fixed multi-machine job pass torchrun's flags in --torchrun-args")
    one_machine = not any(a.startswith(("--nnodes", "--rdzv", "--standalone")) for a in argv)
    if one_machine:  # as --standalone, but reachable from this machine only
        argv = [*standalone_args(), *argv]
    with loopback_stores() if one_machine else nullcontext():
        torchrun([f"--nproc-per-node={args.nproc}", *argv, args.script, *args.script_args])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="varuna-fx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="compile the built-in GPT, print its plan and a stage")
    demo.add_argument("--layers", type=int, default=8)
    demo.add_argument("--stages", type=int, default=4)
    demo.add_argument("--schedule", default="varuna")
    demo.add_argument("--tracer", default="auto")
    demo.add_argument("--show-stage", type=int, default=1)
    demo.set_defaults(func=cmd_demo)

    inspect = sub.add_parser("inspect", help="partition a model and print its stage code")
    inspect.add_argument("--model", required=True, help="module:factory returning (model, inputs)")
    inspect.add_argument("--stages", type=int, default=2)
    inspect.add_argument("--stage", type=int, default=None, help="only this stage's code")
    inspect.add_argument("--tracer", default="auto")
    inspect.set_defaults(func=cmd_inspect)

    plan = sub.add_parser("plan", help="choose P, D and micro-batch size for a described cluster")
    plan.add_argument("--model", default="varuna_fx.examples:demo_gpt",
                      help="module:factory returning (model, inputs[, ...])")
    plan.add_argument("--gpus", type=int, default=16)
    plan.add_argument("--gpus-per-node", type=int, default=4)
    plan.add_argument("--gpu-memory", default="16GiB")
    plan.add_argument("--intra-node-bandwidth", default="100GB/s")
    plan.add_argument("--inter-node-bandwidth", default="10Gbit/s")
    plan.add_argument("--device", default="cuda")
    plan.add_argument("--global-batch-size", type=int, default=None)
    plan.add_argument("--schedule", default="varuna")
    plan.add_argument("--device-type", default=None,
                      help="a100 | v100 | h100 | h200 | cpu: the device to time with FLOPs")
    plan.add_argument("--flops", default=None, help="sustained throughput, e.g. 150TFLOP/s")
    plan.add_argument("--latency", default="0", help="per message between devices, e.g. 5us")
    plan.add_argument("--stages", type=int, default=None, help="fix P")
    plan.add_argument("--data-parallel", type=int, default=None, help="fix D")
    plan.add_argument("--micro-batch-size", type=int, default=None, help="fix the micro-batch")
    plan.add_argument("--no-recompute", action="store_true", help="stash all activations")
    plan.add_argument("--profile", action="store_true",
                      help="measure this device (cached) instead of FLOP estimates")
    plan.add_argument("--top", type=int, default=5, help="configurations to show")
    plan.add_argument("--tracer", default="auto")
    plan.set_defaults(func=cmd_plan)

    run = sub.add_parser("run", help="launch a training script on local processes (torchrun)")
    run.add_argument("--nproc", type=int, required=True)
    run.add_argument("--torchrun-args", nargs="*", default=[],
                     help="extra torchrun flags, e.g. --nnodes=2 --rdzv-endpoint=host:29400")
    run.add_argument("--elastic", action="store_true",
                     help="machines may leave and join (torchrun's elastic agent, c10d "
                          "rendezvous); the script resumes from vf.latest_checkpoint")
    run.add_argument("--nnodes", default=None, help="with --elastic: MIN:MAX machines")
    run.add_argument("--rdzv-endpoint", default=None,
                     help="with --elastic: HOST:PORT of the machine hosting the rendezvous")
    run.add_argument("--rdzv-id", default="varuna-fx", help="with --elastic: the job's name")
    run.add_argument("--local-addr", default=None,
                     help="with --elastic: this machine's address (the rendezvous host is the "
                          "machine whose address is the endpoint's)")
    run.add_argument("--max-restarts", type=int, default=100,
                     help="with --elastic: restarts after worker failures (joins are free)")
    run.add_argument("--rdzv-conf", default=None,
                     help="with --elastic: extra rendezvous settings key=value[,key=value]")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
