"""A TCPStore for processes of one host, listening on loopback only.

Why: `TCPStore("127.0.0.1", 0, is_master=True)` does not bind that address; its server
listens on every interface (`:::port`), so any host that reaches this one could write the
rendezvous keys of the mp workers or of the DP replicas. Here the listening socket is made
by us on 127.0.0.1 and handed to the store (`master_listen_fd`). See docs/security.md.
"""

from __future__ import annotations

import datetime
import socket

LOOPBACK = "127.0.0.1"


def loopback_store(timeout_s: float):
    """A store server on 127.0.0.1, on a port the OS picks; clients meet it at `.port`."""
    import torch.distributed as dist
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(LOOPBACK, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
                         timeout=datetime.timedelta(seconds=timeout_s))
