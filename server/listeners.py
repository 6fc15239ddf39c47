"""The server's listening sockets, bound before the model loads so that a port in use is found at once.

uvicorn would bind them only once the app starts, minutes later for a large model. These are
bound the way it would (each address the host resolves to, ``SO_REUSEADDR``, IPv6 sockets
IPv6-only; a Unix socket world-writable, as uvicorn makes it) and handed to it. This module
only uses the standard library: the engine core process imports the CLI, and this with it.
"""

from __future__ import annotations

import errno
import os
import socket
import stat

_BACKLOG = 2048  # uvicorn's default


class ListenError(OSError):
    """The address cannot be listened on; the message says which address and why."""


def bind_tcp(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address ``host`` resolves to, on ``port`` (0: one the system picks)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror} (--host)") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address[0], port, *address[2:]))  # port 0: the others take the port the first got
            sock.listen(_BACKLOG)
            port = sock.getsockname()[1]
    except OSError as exc:
        close_all(sockets)
        hint = " (another server is running there? choose another --port)" if _in_use(exc) else ""
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    return sockets


def bind_unix(path: str) -> list[socket.socket]:
    """A listening Unix socket at ``path``; a stale socket file (no server behind it) is replaced."""
    mode = 0o666
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ListenError(f"cannot listen on {path}: it exists and is not a socket (--uds)")
        if _unix_socket_answers(path):
            raise ListenError(f"cannot listen on {path}: another server is listening there (--uds)")
        mode = stat.S_IMODE(os.stat(path).st_mode)
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, mode)
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {path}: {exc.strerror} (--uds)") from None
    return [sock]


def close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def remove_unix_socket(path: str | None) -> None:
    """Remove the socket file this server listened on (once it no longer listens)."""
    if path and os.path.lexists(path) and stat.S_ISSOCK(os.lstat(path).st_mode):
        os.unlink(path)


def _unix_socket_answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _in_use(exc: OSError) -> bool:
    return exc.errno == errno.EADDRINUSE
