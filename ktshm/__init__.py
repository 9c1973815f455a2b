"""ktshm: the shared-memory data plane between the GPU service and the expert workers."""

from ktshm.channel import (
    DTYPE_CODES,
    DTYPES,
    Channel,
    Message,
    cleanup_stale,
    new_channel_name,
)
from ktshm.config import ChannelConfig
from ktshm.errors import (
    ChannelBusy,
    ChannelClosed,
    ChannelFull,
    ChannelNotFound,
    ChannelTimeout,
    KtshmError,
    LayoutMismatch,
    MalformedMessage,
    PayloadTooLarge,
    PeerDied,
    PeerRestarted,
    RemoteError,
)

__all__ = [
    "DTYPES",
    "DTYPE_CODES",
    "Channel",
    "ChannelBusy",
    "ChannelClosed",
    "ChannelConfig",
    "ChannelFull",
    "ChannelNotFound",
    "ChannelTimeout",
    "KtshmError",
    "LayoutMismatch",
    "MalformedMessage",
    "Message",
    "PayloadTooLarge",
    "PeerDied",
    "PeerRestarted",
    "RemoteError",
    "cleanup_stale",
    "new_channel_name",
]
