"""Who and where this process is: the address peers reach it at, and the identities a peer compares to know
a pid means the same process.

The advertised address is what listeners (the side channel, the TCP data plane) tell peers to dial: a
wildcard bind (``0.0.0.0``) is no address another host can use. A pid names the same process for a peer only on the same boot of the same kernel (``boot_id``) and in the same
pid namespace (containers have their own). Read by ``register`` on the registering engine thread and by
``attach`` on the attaching one; cheap, no caching.
"""

from __future__ import annotations

import os
import socket

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})


def default_route_address() -> str:
    """This host's address on its default route (no packet is sent), or what its name resolves to."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routing only, never reached
            return str(probe.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def advertised_host(bound_host: str, advertise_host: str | None = None) -> str:
    """The host peers should dial for a listener bound to ``bound_host``: ``advertise_host`` when set, else
    the bound host, else (a wildcard bind) this host's default-route address."""
    if advertise_host:
        return advertise_host
    return default_route_address() if bound_host in _WILDCARDS else bound_host


def boot_id() -> str:
    """The kernel's random id of this boot ("" when unreadable): equal on both ends <=> one host, one boot."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def host_id() -> str:
    """Host name and boot id (``ucx`` watches a peer's pid only when this matches)."""
    return f"{socket.gethostname()}/{boot_id()}"


def pid_namespace() -> int:
    """Inode of this process's pid namespace (``/proc/self/ns/pid``): equal <=> pids mean the same processes."""
    return os.stat("/proc/self/ns/pid").st_ino
