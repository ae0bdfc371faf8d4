"""``vf.compile(profile=...)``: find, measure or check the profile a compile should use.

Under torchrun every rank measures if any must, rank 0's profile is saved and broadcast, and the
links are measured (``world/network.measure_network``), so every rank plans the same
configuration.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..capture.inputs import BoundInputs
from ..errors import VarunaFxError
from ..world.where import (
    in_process_group,
    init_process_group,
    launched_distributed,
    resolve_timeout,
)
from .cluster import local_device_type
from .measure import ProfileSettings, measure
from .profile import (
    Profile,
    graph_hash,
    load_cached,
    profile_key,
    profile_problem,
    save_cached,
)
from .steady import steady as steady_links


def resolve_profile(gm: fx.GraphModule, bound: BoundInputs, profile: Any,
                    settings: ProfileSettings | None = None,
                    timeout: float | None = None) -> Profile | None:
    """False/None: no profile. A Profile: checked against the graph. True: this device's
    profile from the cache, measured (and cached) when there is none. ``timeout``: the
    user's, for joining the other ranks (None: $VARUNA_FX_TIMEOUT or the default)."""
    if profile is None or profile is False:
        return None
    if isinstance(profile, Profile):
        if profile.graph != graph_hash(gm):
            raise VarunaFxError(
                "profile= was measured for a different graph (another model, or other example "
                "input shapes); pass profile=True to measure this one"
            )
        problem = profile_problem(profile, profile.key, None)
        if problem:
            raise VarunaFxError(f"profile= cannot be used: {problem}; pass profile=True to "
                                "measure this device")
        return profile
    if profile is not True:
        raise VarunaFxError(
            f"profile={profile!r}: pass False (FLOP estimates), True (measure this device) or a "
            "varuna_fx.planner.Profile"
        )
    if any(t.device.type == "meta" for t in [*gm.parameters(), *gm.buffers()]):
        raise VarunaFxError(
            "profile=True runs the model, but its parameters are on the meta device: build it "
            "with real parameters to profile, or plan with FLOP estimates (profile=False)"
        )
    return profile_here(gm, bound, settings or ProfileSettings(), timeout)


def profile_here(gm: fx.GraphModule, bound: BoundInputs, settings: ProfileSettings,
                 timeout: float | None = None) -> Profile:
    """This device's profile, cached by graph, dtype, device and threads. In a distributed run
    every rank measures at once -- each device busy as during training, which matters where
    devices share memory bandwidth or cores -- and rank 0's profile is broadcast, so every
    rank plans the same configuration."""
    dtype = str(next((p.dtype for p in gm.parameters()), torch.float32))
    key = profile_key(gm, local_device_type(), dtype, torch.get_num_threads(), settings.key())
    if launched_distributed():  # join early: ranks measuring apart would plan apart
        init_process_group(timeout=resolve_timeout(timeout))
    group = in_process_group()
    found: list[Profile | None] = [load_cached(key, graph_hash(gm))]
    if group:  # measure on every rank at once (the conditions of the run), if any must
        missing = torch.tensor([float(found[0] is None)])
        dist.all_reduce(missing)
        if missing.item() > 0:
            found[0] = measure(gm, bound, key, settings)
    elif found[0] is None:
        found[0] = measure(gm, bound, key, settings)
    if not group or dist.get_rank() == 0:
        if found[0] is not None and not found[0].from_cache:
            save_cached(found[0])
    if group:
        dist.broadcast_object_list(found, src=0)
        assert found[0] is not None
        found[0].network = steady_links()  # median, rounded, kept: steady.py
    assert found[0] is not None
    return found[0]
