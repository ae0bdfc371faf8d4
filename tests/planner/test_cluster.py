"""Cluster descriptions: units read as documented, bad values named."""

from __future__ import annotations

import pytest

import varuna_fx as vf


def test_units() -> None:
    c = vf.Cluster(gpus=16, gpus_per_node=8, gpu_memory="32GB", intra_node_bandwidth="100GB/s",
                   inter_node_bandwidth="25Gbit/s")
    assert c.gpu_memory == 32 * 10**9
    assert c.intra_node_bandwidth == 100e9
    assert c.inter_node_bandwidth == 25e9 / 8
    assert c.nodes == 2
    assert vf.Cluster(gpus=1, gpu_memory="512MiB").gpu_memory == 512 * 2**20
    assert vf.Cluster(gpus=1, gpu_memory=1024).gpu_memory == 1024


@pytest.mark.parametrize("kwargs, match", [
    ({"gpus": 0}, "positive integer"),
    ({"gpus": 2, "gpus_per_node": 0}, "positive integer"),
    ({"gpus": 2, "device": "tpu"}, "'cuda' or 'cpu'"),
    ({"gpus": 2, "gpu_memory": "lots"}, "cannot read memory size 'lots'"),
    ({"gpus": 2, "inter_node_bandwidth": "fast"}, "cannot read bandwidth 'fast'"),
])
def test_bad_values_say_what_to_write(kwargs: dict, match: str) -> None:
    with pytest.raises(vf.VarunaFxError, match=match):
        vf.Cluster(**kwargs)


def test_local_cluster_is_this_process() -> None:
    local = vf.Cluster.local()
    assert local.gpus == 1 and local.device in ("cpu", "cuda")
    assert local.gpu_memory > 2**30
