"""Peer channels: how `PeerReq` frames travel between the ingress and the model replicas.

`base` defines the interface (`PeerChannel`, `Directory`); `inproc` wires model replicas in one
process; `zmq_channel` uses ZeroMQ (ipc:// on a node, tcp:// across nodes); `unix_channel` the
kernel's SOCK_SEQPACKET sockets on one node, without ZeroMQ's I/O threads; `ray_channel`
uses Ray actor calls and is imported explicitly (it is the only module here importing Ray).
"""

from __future__ import annotations

from tokenrouter_ray.transport.base import (
    ChannelClosed,
    Directory,
    Endpoint,
    InMemoryDirectory,
    PeerChannel,
    PeerUnreachableError,
    UnknownPeerError,
    endpoint_model,
    endpoint_name,
)
from tokenrouter_ray.transport.inproc import InProcChannel, InProcHub
from tokenrouter_ray.transport.unix_channel import UnixChannel
from tokenrouter_ray.transport.zmq_channel import ZmqChannel

__all__ = [
    "ChannelClosed",
    "Directory",
    "Endpoint",
    "InMemoryDirectory",
    "InProcChannel",
    "InProcHub",
    "PeerChannel",
    "PeerUnreachableError",
    "UnixChannel",
    "UnknownPeerError",
    "ZmqChannel",
    "endpoint_model",
    "endpoint_name",
]
