"""gRPC plumbing of the workers' token (worker_token.py): the check on the worker's server and
the metadata every call of the GPU side carries."""

from __future__ import annotations

import hmac

import grpc

from ktserve.worker_token import METADATA_KEY, OPEN_METHODS


class CheckToken(grpc.ServerInterceptor):
    """Server side: every call but health must carry the token (UNAUTHENTICATED otherwise)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_METHODS):
            return continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY, "")
        if hmac.compare_digest(sent.encode(), self._token):
            return continuation(handler_call_details)

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"{method}: this worker takes calls only with its token")  # fmt: skip

        return grpc.unary_unary_rpc_method_handler(refuse)


class _SendToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._metadata = ((METADATA_KEY, token),)

    def _details(self, details):
        metadata = tuple(details.metadata or ()) + self._metadata
        return _Details(details.method, details.timeout, metadata, details.credentials,
                        getattr(details, "wait_for_ready", None),
                        getattr(details, "compression", None))  # fmt: skip

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = (
            credentials, wait_for_ready, compression,
        )  # fmt: skip


def worker_channel(address: str, token: str | None, options=()) -> grpc.Channel:
    """A gRPC channel to a worker whose calls carry `token` (when there is one)."""
    channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _SendToken(token)) if token else channel
