"""ktshm: the shared-memory data plane between the GPU service and the expert workers."""

from ktshm.channel import (
    DTYPE_CODES,
    DTYPES,
    NAME_TAG_ENV,
    SEGMENT_PREFIX,
    Channel,
    Message,
    cleanup_stale,
    name_prefix,
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
    "NAME_TAG_ENV",
    "PayloadTooLarge",
    "PeerDied",
    "PeerRestarted",
    "RemoteError",
    "SEGMENT_PREFIX",
    "cleanup_stale",
    "name_prefix",
    "new_channel_name",
]
