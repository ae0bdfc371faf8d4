"""bench/bench_slow_links.py's pure parts (issue 31's harness): --setting flags reach vf.compile,
the wire-bytes formula, /proc/net/dev parsing, step-time and time-to-loss statistics, the run
files and the report. Nothing here launches a process or needs root."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import slow_links_parts as parts  # noqa: E402

from support.netns import interface_bytes  # noqa: E402


class FakeLibrary:
    """Stands in for a varuna_fx that has the issue's classes."""

    class PowerSGD:
        def __init__(self, rank: int = 4) -> None:
            self.rank = rank

    class DiLoCo:
        def __init__(self, every: int = 50, outer_lr: float = 0.7) -> None:
            self.every, self.outer_lr = every, outer_lr


def test_settings_become_compile_keywords() -> None:
    got = parts.parse_setting("compression=int8,replica_sync=powersgd:4,recompute=false,"
                              "stages=none,timeout=60.5", FakeLibrary)
    assert got["compression"] == "int8" and got["recompute"] is False
    assert got["stages"] is None and got["timeout"] == 60.5
    assert isinstance(got["replica_sync"], FakeLibrary.PowerSGD) and got["replica_sync"].rank == 4
    diloco = parts.parse_setting("replica_sync=DiLoCo:every=20:outer_lr=0.5", FakeLibrary)
    assert (diloco["replica_sync"].every, diloco["replica_sync"].outer_lr) == (20, 0.5)
    assert parts.parse_setting("defaults") == {} and parts.label("defaults") == "defaults"
    assert parts.label("compression=int8,replica_sync=powersgd:4") == \
        "compression-int8_replica_sync-powersgd_4"
    for bad, why in (("compression", "key=value"), ("a=1,a=2", "twice"),
                     ("replica_sync=topk:3", "no such class")):
        with pytest.raises(ValueError, match=why):
            parts.parse_setting(bad, FakeLibrary)


def test_a_setting_reaches_compile_and_trains_as_eager() -> None:
    """The flag plumbing with an option that exists today (schedule=1f1b): one process, the
    bench's flat GPT, one step equal to eager's on the same batch."""
    import slow_links_systems as systems

    from varuna_fx.examples import GPTConfig, lm_loss

    cfg = GPTConfig(vocab_size=300, block_size=8, n_layer=2, n_head=2, n_embd=16)
    job = dict(setting="schedule=1f1b,recompute=false", stages=2, replicas=1,
               micro_batches=2, batch=4, lr=1e-3, seed=0)
    x = torch.randint(0, 256, (4, 8))
    y = torch.randint(0, 256, (4, 8))
    trainer = systems.varuna(job, cfg, x)
    assert "1f1b" in trainer.note and "P=2 D=1" in trainer.note
    eager = systems.gpt_layers(cfg, 0)
    with torch.no_grad():
        expected = float(lm_loss(eager(x), y))
    assert trainer.step(x, y) == pytest.approx(expected, rel=1e-6)
    cut = 2 * 8 * 16 * 4  # micro-batch 2 x 8 positions x width 16, fp32
    assert trainer.formula == pytest.approx(2 * 2 * cut)  # forward and back, 2 micro-batches
    assert systems.even_cuts(8, 2) == [0, 5, 10]


def test_wire_formula() -> None:
    assert parts.boundary_payload([2, 8, 16]) == 2 * 8 * 16 * 4
    assert parts.boundary_payload([2, 8, 16], "bf16") == 2 * 8 * 16 * 2
    assert parts.boundary_payload([2, 8, 16], "int8") == 2 * 8 * 16 + 4 * 2 * 8
    assert parts.boundary_payload([2, 8, 16], "auto") is None
    assert parts.pipeline_bytes([100.0, 50.0], micro_batches=4, replicas=2) == 2 * 4 * 2 * 150
    stages = [[[10, 20], [20]], [[30, 40]]]
    full = 4 * (200 + 20 + 1200)
    assert parts.sync_bytes(stages, 1) == 0
    assert parts.sync_bytes(stages, 2) == 2 * full            # each of 2 ranks sends it all
    assert parts.sync_bytes(stages, 4) == 2 * 3 * full
    assert parts.sync_bytes(stages, 2, sharded=True) == 3 * full  # + the all-gather
    assert parts.sync_bytes(stages, 2, "bf16") == full
    assert parts.sync_bytes(stages, 2, "diloco:10") == 2 * full / 10
    # rank 2: P 10x2 + Q 20x2 for the first matrix, 30x2 + 40x2 for the second; the vector whole
    assert parts.sync_bytes(stages, 2, "powersgd:2") == 2 * 4 * (60 + 20 + 140)
    assert parts.sync_bytes(stages, 2, "auto") is None


def test_interface_counters() -> None:
    text = ("Inter-|   Receive                                                |  Transmit\n"
            " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets "
            "errs drop fifo colls carrier compressed\n"
            "    lo:  123 1 0 0 0 0 0 0  123 1 0 0 0 0 0 0\n"
            "peers0: 9876543 70 0 0 0 0 0 0 1234567 60 0 0 0 0 0 0\n")
    assert interface_bytes(text, "peers0") == (9876543, 1234567)
    with pytest.raises(KeyError):
        interface_bytes(text, "peers1")


def test_statistics() -> None:
    ends = [[1.0, 2.5, 3.0], [1.2, 2.0, 3.5]]  # two ranks' step ends
    assert parts.step_times(ends, 0.0) == pytest.approx([1.2, 1.3, 1.0])
    median, rel = parts.spread([1.0, 1.0, 1.0, 2.0])
    assert median == 1.0 and rel > 0
    losses = [5.0, 4.0, 3.0, 2.0, 1.0]
    assert parts.smoothed(losses, 2) == [5.0, 4.5, 3.5, 2.5, 1.5]
    assert parts.final_loss(losses, 2) == 1.5
    times = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert parts.time_to_loss(times, losses, 3.5, 2) == 3.0
    assert parts.time_to_loss(times, losses, 0.5, 2) is None


def test_batches_are_the_same_everywhere_and_cover_an_epoch() -> None:
    order = [w for k in range(5) for w in parts.batch_windows(k, 4, 20, seed=3)]
    assert sorted(order) == list(range(20))   # one epoch: every window once
    assert parts.batch_windows(5, 4, 20, 3) != parts.batch_windows(0, 4, 20, 3)  # next epoch
    assert parts.batch_windows(2, 4, 20, 3) == order[8:12]
    assert parts.window_starts(101, 10) == 10


def test_runs_round_trip_and_report(tmp_path: Path) -> None:
    from slow_links_report import report

    def run(system: str, setting: str, scale: float) -> dict:
        head = dict(system=system, setting=setting, nodes=4, stages=2, replicas=2,
                    link="100mbit", batch=16, seq_len=32, micro_batches=4, layers=8, width=512,
                    vocab=16000, corpus_sha256="ab", first_batch_sum=7, load=1.0,
                    step_median_s=scale, step_spread=0.1, wire_counted=2.1e6,
                    wire_formula=2e6, peak_rss=[2**30, 2**30], notes=["P=2 D=2"], warmup=2,
                    extra={"predicted_step_s": 1.1 * scale})
        rows = [dict(step=k, loss=5.0 - k * 0.1, t=(k + 1) * scale, step_s=scale)
                for k in range(10)]
        path = tmp_path / "n4-P2xD2-100mbit" / f"{system}.{parts.label(setting)}.jsonl"
        parts.write_run(path, head, rows)
        return parts.read_run(path)

    runs = [run("varuna_fx", "defaults", 1.0),
            run("varuna_fx", "compression=int8,replica_sync=powersgd:4", 0.4)]
    assert runs[1]["steps"][3]["loss"] == pytest.approx(4.7)
    text = report(runs, tmp_path, write=False, smoke=True)
    assert "| varuna_fx [compression=int8,replica_sync=powersgd:4] | 400 |" in text
    assert "time to exact's final loss 0.40x" in text
    # the simulator against the measured mean step (issue 31 item 4)
    assert "simulator 440 ms against 400 ms measured (mean), error +10.0% (target within 10%: met)" in text
    assert (tmp_path.parent / f"{tmp_path.name}.png").exists()
    (tmp_path / "bad.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match="no header"):
        parts.read_run(tmp_path / "bad.jsonl")
