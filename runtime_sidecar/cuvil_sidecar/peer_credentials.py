"""Which user a local TCP client runs as: the owner of its socket, read from the kernel's socket
tables (``/proc/net/tcp``, ``/proc/net/tcp6``) of this network namespace, which a pod's
containers share. The sidecar uses it to map only shared memory the client itself could have
created (shared_memory.py); a peer it cannot find gets no such trust.
"""

from __future__ import annotations

import ipaddress
import struct
from pathlib import Path

TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def _kernel_address(host: str, port: int) -> set[str]:
    """The ways the socket tables write ``host:port`` (hex, in the kernel's byte order)."""
    address = ipaddress.ip_address(host)
    forms: set[str] = set()
    v4 = address if isinstance(address, ipaddress.IPv4Address) else address.ipv4_mapped
    if v4 is not None:
        forms.add(f"{struct.unpack('<I', v4.packed)[0]:08X}:{port:04X}")
        packed = ipaddress.IPv6Address(f"::ffff:{v4}").packed
    else:
        packed = address.packed
    words = struct.unpack("<4I", packed)  # four 32-bit words, each in little-endian order
    forms.add("".join(f"{word:08X}" for word in words) + f":{port:04X}")
    return forms


def peer_uid(host: str, port: int, tables: tuple[Path, ...] = TABLES) -> int | None:
    """The uid owning the TCP socket bound at ``host:port`` on this host, or None."""
    try:
        wanted = _kernel_address(host, port)
    except ValueError:
        return None
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and fields[1].upper() in wanted:
                return int(fields[7])
    return None


def grpc_peer_uid(peer: str) -> int | None:
    """The uid of a gRPC peer (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``) on this host;
    None for a Unix-socket peer or one not found."""
    kind, _, address = peer.partition(":")
    host, _, port = address.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return None
    return peer_uid(host.strip("[]"), int(port))
