"""Where the `jwt` provider's JWK Set comes from while the connector runs (MQTT_AUTH_JWT_JWKS): a file, read
again when it changed, or an http(s) URL (the token issuer's JWKS endpoint), asked again every
MQTT_AUTH_JWT_JWKS_REFRESH_S. A set that does not load (unreachable, not a set, a private key in it) keeps the
current one, so an issuer's outage never takes the keys away; a URL not reached since start-up leaves the
provider answering 0x88 Server unavailable (tbmq_auth.PendingKeys) and is tried again with back-off.

A URL is asked conditionally (RFC 9110 13.1: If-None-Match with the ETag, If-Modified-Since with the
Last-Modified of the set last loaded): an unchanged set costs the issuer a 304 and the connector nothing, and a
200 whose body is the set already loaded is not loaded again. An https endpoint is verified against
MQTT_AUTH_JWT_JWKS_CA_FILE, or the system's CAs.
"""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from pathlib import Path

from tbmq_platform.watch import file_stamps


def is_http_url(source: str) -> bool:
    """An http(s) URL (fetched), not a file path: MQTT_AUTH_JWT_JWKS, MQTT_AUTH_HTTP_URL."""
    return source.startswith(("http://", "https://"))


MAX_BYTES = 1024 * 1024  # a key set larger than this is refused, not read into memory
FETCH_TIMEOUT_S = 10.0
NOT_MODIFIED = 304


class KeySetSource:
    """`fetch()` -> the set's bytes when there is something new to load, None when nothing changed since the set
    last `loaded()` (a file's stamps, a URL's 304 or the same body). Blocking (urllib, file reads): run it in a
    thread. Raises OSError / ValueError."""

    def __init__(self, source: str, ca_file: str = "") -> None:
        self.source = source
        self.url = is_http_url(source)
        self._context = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self._seen = None if self.url else file_stamps([source])  # the file start-up loaded
        self._body: bytes | None = None  # the URL's set last loaded, and the validators it came with
        self._validators: dict[str, str] = {}
        self._fetched: tuple[object, bytes | None, dict[str, str]] = (self._seen, None, {})

    def fetch(self) -> bytes | None:
        if self.url:
            headers = {"Accept": "application/json", **self._validators}
            request = urllib.request.Request(self.source, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S,  # noqa: S310 (http(s) only)
                                            context=self._context) as answer:
                    body = answer.read(MAX_BYTES + 1)
                    validators = {ask: answer.headers[got] for got, ask in (("ETag", "If-None-Match"),
                                                                            ("Last-Modified", "If-Modified-Since"))
                                  if answer.headers.get(got)}
            except urllib.error.HTTPError as exc:
                if exc.code == NOT_MODIFIED:
                    return None
                raise
            stamps = None
        else:
            stamps = file_stamps([self.source])
            if stamps == self._seen:
                return None
            with Path(self.source).open("rb") as f:
                body = f.read(MAX_BYTES + 1)
            validators = {}
        if len(body) > MAX_BYTES:
            raise ValueError(f"the key set is larger than {MAX_BYTES} bytes")
        self._fetched = (stamps, body, validators)
        if self.url and body == self._body:
            self._validators = validators
            return None
        return body

    def loaded(self) -> None:
        """The set `fetch()` returned last is the provider's now: what the next `fetch()` compares with."""
        self._seen, self._body, self._validators = self._fetched


__all__ = ["FETCH_TIMEOUT_S", "MAX_BYTES", "KeySetSource", "is_http_url"]
