"""Issue 10: Cluster.local() reads a 100 Mbit/s link as 100 Mbit/s -- two ranks in two network
namespaces joined by a veth pair shaped with tbf (needs root and iproute2; skipped otherwise)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
ROOT = Path(__file__).resolve().parents[2]


def test_a_100_mbit_link_is_measured_as_such(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("tc") is None:
        pytest.skip("network namespaces and tc need root and iproute2")
    from support.netns import veth_pair
    from support.ranks import free_port, rank_env

    with veth_pair("100mbit") as pair:
        procs, port = [], free_port()
        for rank in (0, 1):
            env = rank_env(rank, 2, port, addr=pair.addresses[0], local=False,
                           GLOO_SOCKET_IFNAME=pair.interfaces[rank], PYTHONPATH=str(ROOT / "src"))
            argv = pair.command(rank, [sys.executable, __file__, str(tmp_path)])
            procs.append(subprocess.Popen(argv, env=env))
        try:
            codes = [p.wait(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert codes == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    bits = ranks[0]["bandwidth"] * 8
    assert 80e6 < bits < 120e6, bits


def _rank_main(out: Path) -> None:
    import torch.distributed as dist

    import varuna_fx as vf

    cluster = vf.Cluster.local(timeout=60.0)
    assert cluster.network is not None and cluster.gpus_per_node == 1
    record = dataclasses.asdict(cluster.network)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
