"""What an engine exposes on a shared node (issue 25; docs/security.md): the TCP stores it
hosts (the mp executor's and the DP front end's rendezvous) listen on loopback only, and
every shared-memory segment its processes map is unnamed or readable by its owner alone.

A store on 0.0.0.0 would let any host write rendezvous keys; a 0644 segment would let any
local user read prompts and activations. Checked on the live processes, not on the code.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from pathlib import Path

import pytest

from spmd_engine import LLM, SamplingParams


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(hex_addr: str, family: int) -> str:
    raw = bytes.fromhex(hex_addr)
    if family == socket.AF_INET:
        return socket.inet_ntop(family, struct.pack("<I", int.from_bytes(raw, "big")))
    return socket.inet_ntop(family, b"".join(struct.pack("<I", int.from_bytes(raw[i:i + 4], "big"))
                                             for i in range(0, 16, 4)))


def listening(pid: int) -> list[str]:
    """The addresses a process's own TCP sockets listen on, from /proc/<pid>/net/tcp{,6}."""
    mine, found = _socket_inodes(pid), []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in mine:  # state LISTEN
                host, port = cols[1].split(":")
                found.append(f"{_address(host, family)}:{int(port, 16)}")
    return found


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1")


def shm_modes(pid: int) -> dict[str, int]:
    """Named /dev/shm segments a process maps -> their permission bits (unlinked ones have none)."""
    modes = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/dev/shm/" in line and not line.endswith("(deleted)"):
            path = "/dev/shm/" + line.split("/dev/shm/", 1)[1].split()[0]
            try:
                modes[path] = stat.S_IMODE(os.stat(path).st_mode)
            except FileNotFoundError:
                continue
    return modes


def test_listening_reads_a_socket_of_this_process():
    """Negative control: a socket bound to every interface is seen as not loopback."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        seen = listening(os.getpid())
        assert f"0.0.0.0:{s.getsockname()[1]}" in seen and not all(is_loopback(a) for a in seen)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(data_parallel_size=2)], ids=["mp", "dp"])
def test_engine_stores_listen_on_loopback_and_segments_are_private(layout):
    before = set(listening(os.getpid()))
    llm = LLM(**layout)
    try:
        llm.generate(["Beautiful is"], SamplingParams(temperature=0.0, max_tokens=4))
        hosted = [a for a in listening(os.getpid()) if a not in before]
        assert hosted, "the engine's rendezvous store was not found among this process's sockets"
        assert all(is_loopback(a) for a in hosted), hosted
        pids = [os.getpid(), *[c.pid for c in __import__("multiprocessing").active_children()]]
        for pid in pids:
            for path, mode in shm_modes(pid).items():
                assert mode & 0o077 == 0, f"{path} mapped by {pid} has mode {oct(mode)}"
    finally:
        llm.shutdown()
