"""Mutual TLS on the gRPC surfaces between the services: device-persistence and app-delivery serve; the
connector, the router and the session registry call.

    tls = settings.grpc_tls                       # GRPC_TLS_CERT_FILE, _KEY_FILE, _CA_FILE, _SERVER_NAME, _PEER_NAMES
    server = grpc.aio.server(interceptors=tls.server_interceptors())
    port = tls.add_port(server, "0.0.0.0:9061")  # a server's listening port (TLS or plaintext)
    channel = tls.channel("dp-1:9061", options=CHANNEL_OPTIONS)   # a client's channel

Guarantee, when the three files are set: a server of the suite completes a handshake only with a peer that
presents a certificate chaining to GRPC_TLS_CA_FILE (a client without one, with one of another CA, or speaking
plaintext is refused before any call reaches a handler), and a client talks only to a server whose certificate
chains to that CA and names the target's host (or GRPC_TLS_SERVER_NAME). Every instance presents its own
certificate both ways, so one certificate per instance carries both extended key usages (serverAuth,
clientAuth) or none.

With GRPC_TLS_PEER_NAMES (shell patterns, e.g. `connector-*,router-*`), a server also answers only callers
whose certificate names one of them (its CN or a DNS name of its subjectAltName): any other call ends with
PERMISSION_DENIED before its handler runs, so a certificate of the CA issued to another service (the admin's,
a stolen one of a service that never calls this one) is not a key to every surface. Unset: any certificate of
the CA.

Off (no file set, the default): plaintext, for the loopback (`make run`) or a private network.

A server reads the three files again when one of them changed (checked at each new handshake): a renewed
certificate or a new CA bundle applies to the next connection without a restart. A client reads them when its
channel opens; a channel lives as long as its service, so a client's renewed certificate needs that service's
restart (rotate CAs by adding the new one to every bundle first).
"""

from __future__ import annotations

import fnmatch
import inspect
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from .watch import file_stamps


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


@dataclass(frozen=True)
class GrpcTls:
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    server_name: str = ""  # the name checked in servers' certificates instead of the target's host
    peer_names: tuple[str, ...] = ()  # patterns a caller's certificate name must match (empty: any)

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.key_file or self.ca_file)

    def problems(self) -> list[str]:
        """What keeps these settings from working (empty when off or sound): all three files or none, each
        readable, the certificate matching its key, the CA file holding certificates."""
        if not self.enabled:
            return [f"{name} is used with GRPC_TLS_CERT_FILE only" for name, on in (
                ("GRPC_TLS_SERVER_NAME", self.server_name), ("GRPC_TLS_PEER_NAMES", self.peer_names)) if on]
        files = {"GRPC_TLS_CERT_FILE": self.cert_file, "GRPC_TLS_KEY_FILE": self.key_file,
                 "GRPC_TLS_CA_FILE": self.ca_file}
        missing = [name for name, path in files.items() if not path]
        if missing:
            return [f"{', '.join(missing)} must be set with the other GRPC_TLS_*_FILE settings (mutual TLS needs "
                    "this instance's certificate, its key and the peers' CA)"]
        problems = [f"{name}={path!r}: not a readable file" for name, path in files.items()
                    if not (os.path.isfile(path) and os.access(path, os.R_OK))]
        if problems:
            return problems
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, ValueError) as exc:
            problems.append(f"GRPC_TLS_CERT_FILE / GRPC_TLS_KEY_FILE: not a PEM certificate and its key ({exc})")
        try:
            ctx.load_verify_locations(cafile=self.ca_file)
        except (ssl.SSLError, ValueError) as exc:
            problems.append(f"GRPC_TLS_CA_FILE={self.ca_file!r}: no PEM certificate in it ({exc})")
        return problems

    # -- server ------------------------------------------------------------------------------------------
    def _stamps(self) -> tuple:
        return file_stamps((self.cert_file, self.key_file, self.ca_file))

    def _server_config(self) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(_read(self.key_file), _read(self.cert_file))], root_certificates=_read(self.ca_file))

    def server_credentials(self) -> Any:
        """Credentials requiring a client certificate of the CA; the files are read again once changed."""
        seen = [self._stamps()]

        def fetch() -> Any:  # called by gRPC before each new handshake: None keeps the current configuration
            stamps = self._stamps()
            if stamps == seen[0] or None in stamps:
                return None
            try:
                config = self._server_config()
            except (OSError, ValueError):  # a file half replaced: keep what works, try at the next handshake
                return None
            seen[0] = stamps
            return config

        return grpc.dynamic_ssl_server_credentials(self._server_config(), fetch,
                                                   require_client_authentication=True)

    def server_interceptors(self) -> list:
        """What a grpc.aio server is created with: the check of GRPC_TLS_PEER_NAMES when on and set."""
        return [PeerNames(self.peer_names)] if self.enabled and self.peer_names else []

    def add_port(self, server: Any, address: str) -> int:
        """Bind `address` on a grpc(.aio) server, TLS when on; the bound port (0: the bind failed)."""
        if not self.enabled:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.server_credentials())

    # -- client ------------------------------------------------------------------------------------------
    def channel_credentials(self) -> Any:
        """The credentials of a client channel: the CA bundle, and this instance's certificate and key."""
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca_file), private_key=_read(self.key_file),
                                            certificate_chain=_read(self.cert_file))

    def channel(self, target: str, *, options: Sequence[tuple[str, Any]] = (), interceptors: Sequence = ()) -> Any:
        """A grpc.aio channel to `target`: TLS presenting this instance's certificate when on."""
        kwargs: dict[str, Any] = {"options": list(options)}
        if interceptors:
            kwargs["interceptors"] = list(interceptors)
        if not self.enabled:
            return grpc.aio.insecure_channel(target, **kwargs)
        if self.server_name:
            kwargs["options"].append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.aio.secure_channel(target, self.channel_credentials(), **kwargs)


def certificate_names(auth_context: dict[str, list[bytes]]) -> list[str]:
    """A TLS caller's certificate names as gRPC's auth context gives them: its CN, then its subjectAltNames."""
    return [n.decode(errors="replace") for key in ("x509_common_name", "x509_subject_alternative_name")
            for n in auth_context.get(key, ())]


def name_allowed(names: Sequence[str], patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns)


class PeerNames(grpc.aio.ServerInterceptor):
    """Ends every call whose caller's certificate names none of `patterns` with PERMISSION_DENIED, before its
    handler runs (the handler is wrapped: grpc.aio gives interceptors no peer, the call's context has it)."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = tuple(patterns)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        patterns = self.patterns

        async def check(context) -> None:
            names = certificate_names(context.auth_context())
            if not name_allowed(names, patterns):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"certificate {names[:1] or ['(none)']} not allowed by GRPC_TLS_PEER_NAMES")

        if handler is None:  # no such method: a caller not allowed learns nothing, not even that
            async def unknown(request, context):
                await check(context)
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return grpc.unary_unary_rpc_method_handler(unknown)

        def guard(behavior):
            if inspect.isasyncgenfunction(behavior):
                async def streamed(request, context):
                    await check(context)
                    async for answer in behavior(request, context):
                        yield answer
                return streamed

            async def called(request, context):
                await check(context)
                return await behavior(request, context)
            return called

        kind = (handler.request_streaming, handler.response_streaming)
        make, behavior = {(False, False): (grpc.unary_unary_rpc_method_handler, handler.unary_unary),
                          (False, True): (grpc.unary_stream_rpc_method_handler, handler.unary_stream),
                          (True, False): (grpc.stream_unary_rpc_method_handler, handler.stream_unary),
                          (True, True): (grpc.stream_stream_rpc_method_handler, handler.stream_stream)}[kind]
        return make(guard(behavior), request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


PLAINTEXT = GrpcTls()

__all__ = ["PLAINTEXT", "GrpcTls", "PeerNames", "certificate_names", "name_allowed"]
