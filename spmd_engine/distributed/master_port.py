"""Is the rendezvous port free, where this process is about to serve it?

Why: launched by hand or by srun (no torchrun agent), global rank 0 hosts the job's TCP store
on MASTER_PORT. A port another job already listens on used to end the run as a runtime
failure (exit 1, `DistNetworkError ... EADDRINUSE`) after the prompts and checkpoint were
read. Trying the bind up front makes it a usage error: one line naming MASTER_PORT, exit 2.
Under torchrun the agent has bound the port already (TORCHELASTIC_USE_AGENT_STORE), so
nothing is checked there. The port is released at once: a job that takes it in between
still fails at the rendezvous, as before.
"""

from __future__ import annotations

import errno
import socket
from typing import Mapping

from spmd_engine.config import ConfigError
from spmd_engine.distributed.launch_env import LaunchEnv


def check_master_port(launch: LaunchEnv, environ: Mapping[str, str]) -> None:
    if launch.rank != 0 or environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # As TCPStore's server does: a port left in TIME_WAIT by a finished job is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", launch.master_port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"MASTER_PORT {launch.master_port} is already in use on this host (another job?): "
                              f"choose a free port") from None
        raise ConfigError(f"MASTER_PORT {launch.master_port}: cannot listen on it: {exc.strerror}") from None
    finally:
        sock.close()
