"""Issue 10: under torchrun, Cluster.local() measures the links (about a second) without
profile=True, and every rank gets the same numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_cluster_local_measures_the_links_and_all_ranks_agree(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", __file__, str(tmp_path)],
                   env=env, check=True, timeout=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["network"] == ranks[1]["network"]
    latency, bandwidth, ar_latency, ar_bandwidth, world, link_latencies, links = \
        ranks[0]["network"]
    assert world == 2
    # every link r -> r + 1 on its own (one here): what the slowest-link numbers summarise
    assert links == [pytest.approx(bandwidth)] and link_latencies == [pytest.approx(latency)]
    assert 0 <= latency < 0.05 and 0 <= ar_latency < 0.05
    assert bandwidth > 1e7 and ar_bandwidth > 1e7  # loopback: far above 10 MB/s
    assert max(r["seconds"] for r in ranks) < 5.0  # "about a second" with slack for CI load
    # the planner prices the pipeline link with the measured bandwidth
    assert ranks[0]["planned_bandwidth"] == pytest.approx(bandwidth)


def _rank_main(out: Path) -> None:
    import dataclasses

    import torch.distributed as dist

    import varuna_fx as vf
    from varuna_fx.world.where import init_process_group

    init_process_group(timeout=60.0)  # so the timing below is the measurement alone
    start = time.perf_counter()
    cluster = vf.Cluster.local()
    seconds = time.perf_counter() - start
    assert cluster.network is not None
    assert vf.Cluster.local(measure_network=False).network is None
    from varuna_fx.planner.network import links

    record = {"network": list(dataclasses.astuple(cluster.network)), "seconds": seconds,
              "planned_bandwidth": links(cluster, 2, 1, cluster.network).partition_bandwidth}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
