"""Where the `jwt` provider's JWK Set comes from while the connector runs (MQTT_AUTH_JWT_JWKS): a file, read
again when it changed, or an http(s) URL (the token issuer's JWKS endpoint), fetched again every
MQTT_AUTH_JWT_JWKS_REFRESH_S. A set that does not load (unreachable, not a set, a private key in it) keeps the
current one, so an issuer's outage never takes the keys away; a URL not reached since start-up leaves the
provider answering 0x88 Server unavailable (tbmq_auth.PendingKeys) and is tried again with back-off.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

from tbmq_platform.watch import file_stamps

def is_http_url(source: str) -> bool:
    """An http(s) URL (fetched), not a file path: MQTT_AUTH_JWT_JWKS, MQTT_AUTH_HTTP_URL."""
    return source.startswith(("http://", "https://"))


MAX_BYTES = 1024 * 1024  # a key set larger than this is refused, not read into memory
FETCH_TIMEOUT_S = 10.0


class KeySetSource:
    """`fetch()` -> the set's bytes when there is something new to load, None when a file did not change.
    Blocking (urllib, file reads): run it in a thread. Raises OSError / ValueError."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.url = is_http_url(source)
        self._seen = None if self.url else file_stamps([source])  # the file start-up loaded

    def fetch(self) -> bytes | None:
        if self.url:
            request = urllib.request.Request(self.source, headers={"Accept": "application/json"})
            with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as answer:  # noqa: S310 (http(s) only)
                body = answer.read(MAX_BYTES + 1)
        else:
            stamps = file_stamps([self.source])
            if stamps == self._seen:
                return None
            with Path(self.source).open("rb") as f:
                body = f.read(MAX_BYTES + 1)
            self._seen = stamps
        if len(body) > MAX_BYTES:
            raise ValueError(f"the key set is larger than {MAX_BYTES} bytes")
        return body


__all__ = ["FETCH_TIMEOUT_S", "MAX_BYTES", "KeySetSource", "is_http_url"]
