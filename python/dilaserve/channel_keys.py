"""Authentication of the engine's worker channel when it crosses the network (TCP): ZeroMQ
CURVE. The engine makes a fresh server key pair and one worker key pair per cluster at
start and hands the worker keys to the workers it launches, in their environment (never on
a command line). A peer without them cannot complete the handshake: it gets no command,
and nothing it sends reaches the engine. IPC channels stay on this machine, in a private
directory, and need no keys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import zmq

#: Environment variables carrying the keys to a worker (Z85 text).
SERVER_KEY_ENV = "DILASERVE_CHANNEL_SERVER_KEY"
PUBLIC_KEY_ENV = "DILASERVE_CHANNEL_PUBLIC_KEY"
SECRET_KEY_ENV = "DILASERVE_CHANNEL_SECRET_KEY"
ENVIRONMENT = (SERVER_KEY_ENV, PUBLIC_KEY_ENV, SECRET_KEY_ENV)


def without_keys(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without any channel keys: a worker gets only the keys its launch hands it."""
    return {name: value for name, value in env.items() if name not in ENVIRONMENT}


@dataclass(frozen=True, repr=False)
class WorkerKeys:
    """What a worker needs to connect: the engine's public key and the workers' pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    def environment(self) -> dict[str, str]:
        return {
            SERVER_KEY_ENV: self.server_public.decode(),
            PUBLIC_KEY_ENV: self.public.decode(),
            SECRET_KEY_ENV: self.secret.decode(),
        }

    @classmethod
    def from_environment(cls, env: MutableMapping[str, str] = os.environ) -> WorkerKeys | None:
        """The keys a launcher handed over, taken out of `env` (so that no child process
        inherits them), or None (an IPC channel needs none)."""
        if not any(name in env for name in ENVIRONMENT):
            return None
        missing = [name for name in ENVIRONMENT if not env.get(name)]
        if missing:
            raise ValueError(f"channel keys incomplete: {', '.join(missing)} not set")
        return cls(*(env.pop(name).encode() for name in ENVIRONMENT))

    def secure(self, socket: zmq.Socket) -> None:
        """Makes `socket` (before it connects) a CURVE client of the engine."""
        socket.curve_serverkey = self.server_public
        socket.curve_publickey = self.public
        socket.curve_secretkey = self.secret

    def __repr__(self) -> str:
        return "WorkerKeys(<hidden>)"


@dataclass(frozen=True, repr=False)
class ChannelKeys:
    """The engine's side: its own key pair and the key pair it gives its workers."""

    server_public: bytes
    server_secret: bytes
    workers: WorkerKeys

    @classmethod
    def generate(cls) -> ChannelKeys:
        if not zmq.has("curve"):
            raise RuntimeError("this pyzmq build has no CURVE support; TCP workers need it")
        server_public, server_secret = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        return cls(server_public, server_secret, WorkerKeys(server_public, public, secret))

    def secure(self, socket: zmq.Socket) -> None:
        """Makes `socket` (before it binds) a CURVE server."""
        socket.curve_secretkey = self.server_secret
        socket.curve_publickey = self.server_public
        socket.curve_server = True

    def admits(self, client_key: bytes) -> bool:
        """Whether a peer presenting `client_key` (Z85) is one of our workers."""
        return client_key == self.workers.public

    def __repr__(self) -> str:
        return "ChannelKeys(<hidden>)"
