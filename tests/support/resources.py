"""What a job's processes hold on this machine: /dev/shm files and TCP ports (Linux /proc only, no torch).

Used by the two-runs-at-once test: each run notes what its whole process group holds while the
other run is alive, and the test checks that the two share nothing.
"""

from __future__ import annotations

import os
from pathlib import Path


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (ranks, DataLoader workers, dispatch processes)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return sorted(pids)


def _links(pid: int) -> list[str]:
    links = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            links.append(os.readlink(fd))
        except OSError:
            continue
    return links


def shm_files(pid: int) -> set[str]:
    """``/dev/shm`` names the process has open or mapped (also ones already unlinked), and the
    ``lsh-*`` segments it owns."""
    names = [t for t in _links(pid) if t.startswith("/dev/shm/")]
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/dev/shm/" in line:
            names.append(line[line.index("/dev/shm/") :])
    owned = {str(p) for p in Path("/dev/shm").glob("lsh-*") if f"-{pid}." in p.name}
    return {n.removesuffix(" (deleted)") for n in names} | owned


def tcp_ports(pid: int) -> set[int]:
    """Local TCP ports of the process's sockets (listening or connected, IPv4 and IPv6)."""
    inodes = {t[len("socket:[") : -1] for t in _links(pid) if t.startswith("socket:[")}
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def snapshot(pgid: int) -> dict[str, list[int] | list[str]]:
    """What process group ``pgid`` holds now: its pids, /dev/shm names and local TCP ports."""
    pids = group_pids(pgid)
    shm: set[str] = set()
    ports: set[int] = set()
    for pid in pids:
        try:
            shm |= shm_files(pid)
            ports |= tcp_ports(pid)
        except OSError:  # exited meanwhile
            continue
    return {"pids": pids, "shm": sorted(shm), "ports": sorted(ports)}
