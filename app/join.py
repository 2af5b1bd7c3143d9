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


def lan_address(request_url: str, ip: str | None = None) -> str | None:
    """For an address only this machine can open (``http://localhost:8501/``): the same scheme and port at this
    machine's network address, the one its default route leaves by (``ip`` for tests; found with a UDP socket's
    connect, which sends nothing), or None when there is none (no network, or only loopback).
    """
    import socket

    parts = urlsplit(request_url)
    if ip is None:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(("10.254.254.254", 1))
                ip = s.getsockname()[0]
        except OSError:
            return None
    try:
        if ipaddress.ip_address(ip).is_loopback or ipaddress.ip_address(ip).is_unspecified:
            return None
    except ValueError:
        return None
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme or 'http'}://{ip}{port}/"


def join_card() -> None:
    """Open the join card as a dialog: the address in large type and as a QR code (Home, the Race page in presenter
    mode and every page's sidebar offer it). Where the presenter's browser is on ``localhost``, it offers this
    machine's detected network address instead, and says so."""
    import html

    import streamlit as st

    @st.dialog("Join on your own device", width="large")
    def _card() -> None:
        try:
            url = st.context.url
        except Exception:  # noqa: BLE001 - no browser context (a test run)
            url = None
        try:
            addr = join_address(url)
        except InputError as e:
            st.error(str(e))
            return
        shown = addr.url
        detected = lan_address(addr.url) if addr.local_only and addr.source == "request" else None
        if detected:
            shown = detected
        # escaped, as HTML text (Markdown escaping would put invisible characters into an address people type)
        st.html(f'<div style="font-size:2.4rem;font-weight:700;line-height:1.2;overflow-wrap:anywhere">'
                f'{html.escape(shown)}</div>')
        st.image(qr_png(shown, scale=12), width=360)
        if detected:
            st.info(f"This browser opened the app at {addr.url}, which only this machine can open; the address above "
                    "is this machine's network address, detected. If phones cannot reach it, set "
                    f"{PUBLIC_URL_ENV} to the address the room can reach.")
        elif addr.local_only:
            st.warning("This address opens only on this machine: open the app by its network address, or set "
                       f"{PUBLIC_URL_ENV} to the address the room can reach.")
        st.caption("Set by the operator (SPEEDUP_LAB_PUBLIC_URL)." if addr.source == "setting"
                   else "Detected from this machine's network." if detected
                   else "The address this browser opened the app at.")

    _card()
