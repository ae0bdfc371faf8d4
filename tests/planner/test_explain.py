"""When nothing fits (planner/explain.py): the memory and what the smallest configuration needs
read differently however close they are (issue 30: "fits in 2.0 MiB ... needs 2.0 MiB"), and
the memory suggested is enough."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import varuna_fx as vf
from varuna_fx.costs.memory import format_bytes, format_bytes_apart
from varuna_fx.planner import explain


def test_two_sizes_that_round_alike_read_apart() -> None:
    mib = 2**20
    assert format_bytes_apart(2 * mib, 2.1 * mib) == ("2.0 MiB", "2.1 MiB")  # as before
    assert format_bytes_apart(2 * mib, 2 * mib + 1000) == \
        ("2.000 MiB (2,097,152 bytes)", "2.001 MiB (2,098,152 bytes)")
    assert format_bytes_apart(mib, mib + 4)[1].endswith("(1,048,580 bytes)")
    assert format_bytes_apart(mib, mib + 0.2)[1].endswith("(1,048,576.2 bytes)")
    assert format_bytes_apart(5, 5) == ("5 bytes", "5 bytes")
    assert format_bytes(3.04 * mib, up=True) == "3.1 MiB"  # enough, not 3.0
    assert format_bytes(3 * mib, up=True) == "3.0 MiB"


def test_nothing_fits_names_numbers_that_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    # the smallest configuration needs 1000 bytes more than the 2 MiB there is
    monkeypatch.setattr(explain, "smallest_memory", lambda planner, c: planner.pricer.memory_cap + 1000)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    with pytest.raises(vf.PlanError) as caught:
        vf.compile(model, vf.Cluster(gpus=1, gpu_memory="2MiB", device="cpu"),
                   example_inputs=(torch.randn(16, 256),), loss_fn=nn.functional.mse_loss)
    message = str(caught.value)
    found = re.search(r"fits in (.+?) per device: the smallest needs (.+?) per device", message)
    assert found is not None, message
    assert found.groups() == ("2.000 MiB (2,097,152 bytes)", "2.001 MiB (2,098,152 bytes)")
    assert "devices with at least 2.1 MiB" in message
