"""The join card: the app's own address in large text and as a QR code, so a room can open the app on their phones.

The address is the operator's ``SPEEDUP_LAB_PUBLIC_URL`` when set (behind a proxy, or when the presenter's browser
reaches the server at an address the room cannot: ``localhost``), else the address the presenter's browser reached
the app at (Streamlit's ``st.context.url``), reduced to its scheme, host and port. The QR code is made by ``segno``
(a maintained QR encoder, ISO/IEC 18004; error correction level M), as a PNG, offline.
"""

from __future__ import annotations

import ipaddress
import io
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from engine.errors import InputError

PUBLIC_URL_ENV = "SPEEDUP_LAB_PUBLIC_URL"
MAX_ADDRESS = 300  # characters; a QR code of level M holds far more, but a room has to read it from the wall


@dataclass(frozen=True)
class JoinAddress:
    """Where the room can open the app.

    Attributes:
        url: the address (scheme://host[:port]/ and, for an operator's setting, its path as given).
        source: "setting" (the operator's environment variable) or "request" (the presenter's browser).
        local_only: the host is this machine only (localhost, 127.0.0.0/8, ::1, 0.0.0.0): phones cannot reach it.
    """

    url: str
    source: str
    local_only: bool


def _local(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in ("localhost", "") or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def _clean(url: str, keep_path: bool) -> tuple[str, str]:
    """(normalized url, host) of an http(s) address. Raises InputError for anything else."""
    url = (url or "").strip()
    if not url or len(url) > MAX_ADDRESS:
        raise InputError(f"The app's address must be an http(s) address of at most {MAX_ADDRESS} characters.")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"The app's address must start with http:// or https:// and name a host, got {url[:80]!r}.")
    if any(c.isspace() for c in url):
        raise InputError("The app's address must not contain spaces.")
    path = parts.path if keep_path and parts.path else "/"
    return f"{parts.scheme}://{parts.netloc}{path}", parts.hostname


def join_address(request_url: str | None, env: dict | None = None) -> JoinAddress:
    """The address to show on the join card (see the module docstring).

    Args:
        request_url: the URL the presenter's browser shows (``st.context.url``; None when unknown).
        env: the environment to read ``SPEEDUP_LAB_PUBLIC_URL`` from (default ``os.environ``).

    Raises:
        InputError: an operator's setting that is not an http(s) address, or no address at all.
    """
    env = os.environ if env is None else env
    setting = (env.get(PUBLIC_URL_ENV) or "").strip()
    if setting:
        try:
            url, host = _clean(setting, keep_path=True)
        except InputError as e:
            raise InputError(f"{PUBLIC_URL_ENV}: {e}") from None
        return JoinAddress(url, "setting", _local(host))
    if not request_url:
        raise InputError(f"The app's address is unknown here: set {PUBLIC_URL_ENV} to the address the room can "
                         "open (for example http://192.168.1.20:8501/).")
    url, host = _clean(request_url, keep_path=False)
    return JoinAddress(url, "request", _local(host))


def qr_png(text: str, scale: int = 10, border: int = 2) -> bytes:
    """A QR code of ``text`` as PNG bytes (segno, error correction M; ``scale`` px per module, ``border`` modules of
    quiet zone).

    Raises:
        InputError: empty text, or scale / border out of range (scale 1..40, border 0..10).
    """
    import segno

    if not text:
        raise InputError("Nothing to encode in the QR code.")
    if not (1 <= scale <= 40 and 0 <= border <= 10):
        raise InputError(f"QR scale must be 1..40 and border 0..10, got {scale} and {border}.")
    buf = io.BytesIO()
    segno.make(text, error="m", micro=False).save(buf, kind="png", scale=scale, border=border)
    return buf.getvalue()
