"""ktshm's exceptions, and the one place where C status codes become them."""

from __future__ import annotations

# NOTE: values mirror enum kt_status in ktshm.h.
OK = 0
ETIMEOUT = 1
EPEER_DIED = 2
EPEER_RESTARTED = 3
EBADMSG = 4
ETOOLARGE = 5
EREMOTE = 6
ESYS = 7


class KtshmError(Exception):
    """Base of every ktshm error."""


class ChannelNotFound(KtshmError, FileNotFoundError):
    """No channel of that name exists (never created, or already closed by its creator)."""


class LayoutMismatch(KtshmError):
    """The segment is not a ktshm channel of this layout version."""


class UntrustedSegment(KtshmError, PermissionError):
    """The segment belongs to another user, or others may open it: not attached."""


class ChannelCorrupt(KtshmError):
    """The segment holds a state no protocol step leads to: tear the channel down, make anew."""


class ChannelBusy(KtshmError):
    """A live consumer is already attached."""


class ChannelFull(KtshmError):
    """Every slot holds a request or an unreleased reply."""


class ChannelClosed(KtshmError):
    """The channel was closed by this process."""


class PayloadTooLarge(KtshmError, ValueError):
    """The arrays do not fit in one slot region."""


class MalformedMessage(KtshmError):
    """A slot's metadata failed validation; the slot was answered with an error, nothing else."""


class ChannelTimeout(KtshmError, TimeoutError):
    """A wait passed its deadline."""


class PeerDied(KtshmError):
    """The peer's heartbeat stopped: it was killed, crashed or detached."""


class PeerRestarted(KtshmError):
    """A new consumer attached; the requests in flight must be resent (Channel.resend_inflight)."""


class RemoteError(KtshmError):
    """The consumer answered a request with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"peer replied with status {status}: {message}")
        self.status = status
        self.message = message


_BY_STATUS: dict[int, type[KtshmError]] = {
    ETIMEOUT: ChannelTimeout,
    EPEER_DIED: PeerDied,
    EPEER_RESTARTED: PeerRestarted,
    EBADMSG: MalformedMessage,
    ETOOLARGE: PayloadTooLarge,
}


def error_for_status(status: int, context: str, errno: int = 0) -> KtshmError:
    """Turn a kt_status code from the C layer into an exception carrying `context`."""
    if status == ESYS:
        import os

        return KtshmError(f"{context}: system call failed: {os.strerror(errno)} (errno {errno})")
    cls = _BY_STATUS.get(status, KtshmError)
    return cls(f"{context} (status {status})")
