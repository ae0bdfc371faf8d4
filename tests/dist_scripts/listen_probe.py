"""`varuna-fx run --nproc 2 listen_probe.py OUT`: rank 0 writes MASTER_ADDR and the local
addresses its launcher (the parent process: torchrun's agent, which hosts the rendezvous and
master stores) listens on, one per line, to OUT; every rank writes what it listens on itself
(gloo's pair sockets) to OUT.worker<rank>."""

import os
import sys
from pathlib import Path


def listening(pid: int) -> list[str]:
    """host:port of every TCP socket ``pid`` listens on (from /proc, no tools needed)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            if width == 8:
                host = ".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                host = "::" if set(address) == {"0"} else address
            found.append(f"{host}:{int(port, 16)}")
    return found


if os.environ["RANK"] == "0":
    lines = [os.environ.get("MASTER_ADDR", "?"), *listening(os.getppid())]
    Path(sys.argv[1]).write_text("\n".join(lines))

# the workers' own gloo pair sockets, once the process group is up
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
dist.barrier()
Path(f"{sys.argv[1]}.worker{os.environ['RANK']}").write_text("\n".join(listening(os.getpid())))
dist.barrier()
dist.destroy_process_group()
