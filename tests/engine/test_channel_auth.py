"""The worker channel over TCP authenticates its peers (ZeroMQ CURVE): a peer without the
cluster's keys gets no command and its messages are dropped; a worker given the keys
through its environment is served."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
import zmq

from dilaserve.channel_keys import WorkerKeys
from dilaserve.engine.transport import SendError, WorkerChannel
from dilaserve.protocol import Shutdown, WorkerLeaving, decode_engine_message, encode

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="pyzmq without CURVE")


def _peer(endpoint: str, worker_id: int, keys: WorkerKeys | None) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, str(worker_id).encode())
    socket.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.secure(socket)
    socket.connect(endpoint)
    return socket


async def _exchange(peer_keys) -> tuple[list[int], bool, bool]:
    """Starts a TCP channel, lets a peer with `peer_keys(channel)` send one message and
    the channel try to send it one; returns the worker ids heard from, whether the send
    was accepted and whether the peer received anything."""
    heard: list[int] = []
    channel = WorkerChannel(lambda worker, message: heard.append(worker), "127.0.0.1")
    channel.start()
    peer = _peer(channel.endpoint, 7, peer_keys(channel))
    try:
        for _ in range(50):  # the handshake, if any, completes within this
            with contextlib.suppress(zmq.Again):  # no handshake: nowhere to queue it
                peer.send(encode(WorkerLeaving(1)), zmq.NOBLOCK)
            await asyncio.sleep(0.02)
            if heard:
                break
        try:
            channel.send(7, Shutdown())
            sent = True
        except SendError:
            sent = False
        received = bool(peer.poll(500))
        if received:
            assert isinstance(decode_engine_message(peer.recv()), Shutdown)
        return heard, sent, received
    finally:
        peer.close()
        await channel.close()


def _run(coroutine):
    """Runs `coroutine` on a loop of its own, leaving the thread's event loop alone."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


def test_a_worker_with_the_clusters_keys_is_served():
    heard, sent, received = _run(_exchange(lambda channel: channel.worker_keys))
    assert heard and set(heard) == {7} and sent and received


@pytest.mark.parametrize(
    "keys",
    [
        lambda channel: None,  # no CURVE at all
        lambda channel: WorkerKeys(channel.worker_keys.server_public, *zmq.curve_keypair()),
    ],
    ids=["plain", "own-keys"],
)
def test_a_peer_without_the_keys_gets_nothing_and_is_not_heard(keys):
    heard, sent, received = _run(_exchange(keys))
    assert heard == [] and not sent and not received


def test_keys_travel_in_the_environment_not_the_command_line(tmp_path):
    from dilaserve.channel_keys import ChannelKeys
    from dilaserve.engine.launcher import WorkerSpec
    from dilaserve.protocol import CacheMode

    keys = ChannelKeys.generate().workers
    spec = WorkerSpec(1, 1, "tcp://127.0.0.1:1", "m", CacheMode.DUAL, 4, keys=keys)
    assert not any(keys.secret.decode() in arg for arg in spec.argv())
    assert WorkerKeys.from_environment(os.environ | spec.environment()) == keys
    assert WorkerKeys.from_environment({}) is None
    assert keys.secret.decode() not in repr(spec)
