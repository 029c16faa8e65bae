"""A free TCP port on the loopback interface, for the processes the workbench starts itself
(torch.distributed's rendezvous, Prometheus, the soak's server)."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port the OS just reported free on 127.0.0.1 (bound, read and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
