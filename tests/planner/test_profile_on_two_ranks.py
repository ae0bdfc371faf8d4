"""Issue 5 on two gloo ranks: profile=True measures on every rank, broadcasts rank 0's profile
and a measured network, and every rank plans -- and runs -- the same configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_ranks_plan_the_same_configuration_from_one_profile(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VARUNA_FX_CACHE_DIR": str(tmp_path / "cache")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", __file__, str(tmp_path)],
                   env=env, check=True, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["plan"] == ranks[1]["plan"]
    assert ranks[0]["loss"] == pytest.approx(ranks[1]["loss"])
    assert all(r["network"] for r in ranks) and ranks[0]["network"] == ranks[1]["network"]
    assert len(list((tmp_path / "cache" / "profiles").glob("*.json"))) == 1  # rank 0, once


def _rank_main(out: Path) -> None:
    import torch
    import torch.distributed as dist

    import varuna_fx as vf
    from varuna_fx.examples import GPT, GPTConfig, lm_loss
    from varuna_fx.planner import analyze

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, vocab_size=128, block_size=16))
    tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    profile = analyze(model, (x,)).profile()  # joins the group, measures, broadcasts
    pipe = vf.compile(model, example_inputs=(x,), loss_fn=lm_loss, global_batch_size=8,
                      profile=profile)  # the planner chooses P and D for the 2 ranks
    plan = pipe.plan
    share = 8 // plan.data_parallel
    start = pipe.replica_index * share
    loss = float(pipe.step(x[start:start + share], target=y[start:start + share]))
    network = profile.network
    record = {"plan": [plan.stages, plan.data_parallel, plan.micro_batch_size],
              "loss": loss, "network": None if network is None else
              [network.latency, network.bandwidth]}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    pipe.runtime.close()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
