"""`sever_probe.py MODE` on 3 ranks (plain env init, rank 0 hosts the store): rank 2 waits on a
receive from rank 1, which never sends; rank 1 destroys its process group but keeps a
reference to it, as a survivor's leftover would, then (MODE "sever") shuts its connections down
with ``world/sockets.py`` or (MODE "keep") only waits. Rank 2 prints how long its wait took to
fail: at once after a sever, only when rank 1 exits otherwise."""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from varuna_fx.world import sockets

HOLD = 4.0  # seconds rank 1 lives on after its "teardown"


def main() -> None:
    mode, rank = sys.argv[1], int(os.environ["RANK"])
    before = sockets.opened()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    x = torch.ones(16)
    dist.all_reduce(x)
    if rank == 2:
        start = time.monotonic()
        work = dist.irecv(x, src=1)
        try:
            work.wait()
            print("RESULT completed", flush=True)
        except RuntimeError:
            print(f"RESULT failed {time.monotonic() - start:.2f}", flush=True)
    elif rank == 1:
        time.sleep(1.0)
        leftover = (dist.distributed_c10d._get_default_group(), dist.irecv(x, src=0))
        dist.destroy_process_group()
        if mode == "sever":
            store = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
            print(f"SEVERED {sockets.sever(before, {store})}", flush=True)
        time.sleep(HOLD)
        del leftover
    else:
        time.sleep(HOLD + 2.0)  # the store's host stays until the others are done
    os._exit(0)


if __name__ == "__main__":
    main()
