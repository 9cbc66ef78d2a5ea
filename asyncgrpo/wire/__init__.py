"""Wire format (msgpack header + raw array frames) and ZeroMQ channels. See docs/WIRE.md."""

from asyncgrpo.wire.codec import WireError, decode, decode_group, encode, encode_group, example_group
from asyncgrpo.wire.messages import (
    Heartbeat,
    Message,
    MsgType,
    ScoredGroup,
    Shutdown,
    VersionAck,
    WeightsChunk,
)
from asyncgrpo.wire.sockets import Publisher, Receiver, Sender, Subscriber, WireTimeout

__all__ = [
    "Heartbeat",
    "Message",
    "MsgType",
    "Publisher",
    "Receiver",
    "ScoredGroup",
    "Sender",
    "Shutdown",
    "Subscriber",
    "VersionAck",
    "WeightsChunk",
    "WireError",
    "WireTimeout",
    "decode",
    "decode_group",
    "encode",
    "encode_group",
    "example_group",
]
