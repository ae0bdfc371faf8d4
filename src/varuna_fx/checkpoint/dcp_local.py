"""DCP's save and load steps for one process, without ``torch.distributed``.

``dcp.save`` / ``dcp.load`` with ``no_dist=True`` warn on every call that they assume one
process (also on an async save's writer thread, where no ``catch_warnings`` reaches), and a
global filter for that warning would hide it from the user's own DCP calls too. In one process
the collective steps are trivial, so these run the same planner and storage protocol
(``SavePlanner``/``StorageWriter``, ``LoadPlanner``/``StorageReader``) directly. Distributed runs
keep using ``dcp.save`` / ``dcp.load`` / ``dcp.async_save``.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter


def save(state: dict[str, Any], writer: StorageWriter, planner: SavePlanner) -> Metadata:
    """What ``dcp.save`` does on a world of one."""
    planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(),
                           is_coordinator=True)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])
    plans = writer.prepare_global_plan(plans)
    written = writer.write_data(planner.finish_plan(plans[0]), planner)
    written.wait()
    writer.finish(metadata=metadata, results=[written.value()])
    return metadata


def load(state: dict[str, Any], reader: StorageReader, planner: LoadPlanner,
         metadata: Metadata | None = None) -> None:
    """What ``dcp.load`` does on a world of one (``metadata``: already read from ``reader``)."""
    if metadata is None:
        metadata = reader.read_metadata()
    planner.set_up_planner(state, metadata, True)
    reader.set_up_storage_reader(metadata, True, rank=0, use_collectives=True)
    local = reader.prepare_local_plan(planner.create_local_plan())
    plans = reader.prepare_global_plan(planner.create_global_plan([local]))
    reader.read_data(planner.finish_plan(plans[0]), planner).wait()
