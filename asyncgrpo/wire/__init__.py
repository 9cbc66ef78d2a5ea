"""Wire format (msgpack header + raw array frames) and ZeroMQ channels. See docs/WIRE.md."""

from asyncgrpo.wire.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_HEADER_BYTES,
    WireError,
    decode,
    decode_group,
    encode,
    encode_group,
    example_group,
)
from asyncgrpo.wire.messages import (
    SCHEMA_VERSION,
    Heartbeat,
    Message,
    MsgType,
    SaveNotice,
    ScoredGroup,
    Shutdown,
    VersionAck,
    WeightsChunk,
)
from asyncgrpo.wire.network import is_loopback
from asyncgrpo.wire.security import (
    CurveClientKeys,
    CurveKeypair,
    CurveServerKeys,
    WireKeys,
)
from asyncgrpo.wire.sockets import (
    Publisher,
    Receiver,
    Rejections,
    Sender,
    Subscriber,
    WireTimeout,
)

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_HEADER_BYTES",
    "SCHEMA_VERSION",
    "CurveClientKeys",
    "CurveKeypair",
    "CurveServerKeys",
    "Heartbeat",
    "Message",
    "MsgType",
    "Publisher",
    "Receiver",
    "Rejections",
    "SaveNotice",
    "ScoredGroup",
    "Sender",
    "Shutdown",
    "Subscriber",
    "VersionAck",
    "WeightsChunk",
    "WireError",
    "WireKeys",
    "WireTimeout",
    "decode",
    "decode_group",
    "encode",
    "encode_group",
    "example_group",
    "is_loopback",
]
