"""A receiving peer in its own process, for cross-process transport tests and the transport benchmark.

Allocates ``--regions`` zeroed regions of ``--blocks`` x ``--block-bytes``, registers them with the chosen
transport and prints ``DESCRIPTOR <hex>`` on stdout (UCX may print warnings to stdout too, hence the tag). Then it serves stdin commands, one per
line: ``digest`` prints ``DIGEST`` and the sha256 of each region, ``exit`` closes the transport and exits.
It does nothing else: a push transport needs no receiver CPU (UCX RMA, cma) or only its I/O thread (TCP).
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

from pd_connector.transport.base import MemoryRegion
from pd_connector.transport.factory import TransportConfig, create_transport
from pd_connector.transport.tcp import TcpConfig
from pd_connector.transport.ucx import UcxConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=["tcp", "cma", "ucx"], required=True)
    parser.add_argument("--tls", default="", help="UCX_TLS for the ucx transport")
    parser.add_argument("--regions", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-bytes", type=int, default=4096)
    args = parser.parse_args()
    buffers = [np.zeros(args.blocks * args.block_bytes, dtype=np.uint8) for _ in range(args.regions)]
    transport = create_transport(
        TransportConfig(kind=args.kind, tcp=TcpConfig(), ucx=UcxConfig(tls=args.tls))
    )
    descriptor = transport.register(
        [MemoryRegion(i, b.ctypes.data, b.nbytes, args.block_bytes) for i, b in enumerate(buffers)]
    )
    print("DESCRIPTOR", descriptor.hex(), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "digest":
            print("DIGEST", " ".join(hashlib.sha256(b.data).hexdigest() for b in buffers), flush=True)
        elif command == "exit":
            break
    transport.close()


if __name__ == "__main__":
    main()
