"""Who and where this process is: the identities a peer compares to know a pid means the same process.

A pid names the same process for a peer only on the same boot of the same kernel (``boot_id``) and in the same
pid namespace (containers have their own). Read by ``register`` on the registering engine thread and by
``attach`` on the attaching one; cheap, no caching.
"""

from __future__ import annotations

import os
import socket

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


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
