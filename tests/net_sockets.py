"""The TCP and UDP sockets that processes hold, from /proc (Linux): to check that nothing leaves loopback.

    bad = non_loopback_sockets(pids)   # [] when every socket's local and remote address is 127.x or ::1

A socket listening on 0.0.0.0 or :: counts as not loopback: it accepts on every interface.
"""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path

TABLES = ("tcp", "tcp6", "udp", "udp6")


def _address(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:  # four little-endian 32-bit words
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def _inodes(pid: int) -> set[int]:
    out = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    except OSError:
        pass
    return out


def sockets(pids: list[int]) -> list[dict]:
    """Each inet socket of these processes: table, local and remote (address, port), state (hex), pid."""
    owner = {inode: pid for pid in pids for inode in _inodes(pid)}
    found = []
    for table in TABLES:
        path = Path(f"/proc/{pids[0] if pids else 'self'}/net/{table}")
        try:
            lines = path.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            inode = int(fields[9])
            if inode in owner:
                found.append({"table": table, "local": _address(fields[1]), "remote": _address(fields[2]),
                              "state": fields[3], "pid": owner[inode]})
    return found


def _loopback(ip: str, remote: bool) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or (remote and addr.is_unspecified)  # an unconnected socket's remote is 0.0.0.0:0


def non_loopback_sockets(pids: list[int]) -> list[dict]:
    return [s for s in sockets(pids) if not (_loopback(s["local"][0], False) and _loopback(s["remote"][0], True))]


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out
