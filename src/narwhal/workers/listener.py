"""The router's listening socket, bound once per worker with SO_REUSEPORT.

Each worker binds its own socket to the same address; the kernel spreads new connections
across them by a hash of the connection, so each worker accepts its share and a busy
worker's accept queue is its own. A worker that dies takes with it only the connections
it had accepted and the few not yet accepted from its own queue; new connections go to
the others until its replacement binds. The supervisor holds one bound socket too (never
listening, so it receives nothing), which keeps the port the workers' while none is up.
"""

from __future__ import annotations

import socket


def shared_listener(host: str, port: int) -> socket.socket:
    """A bound, non-blocking socket others of this user may bind beside (port 0: a free one)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
