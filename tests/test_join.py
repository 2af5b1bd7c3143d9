"""app.join: the detected network address offered where the presenter's browser is on localhost."""

from app.join import lan_address


def test_lan_address_keeps_scheme_and_port():
    assert lan_address("http://localhost:8501/", ip="192.168.1.20") == "http://192.168.1.20:8501/"
    assert lan_address("https://127.0.0.1/", ip="10.0.0.5") == "https://10.0.0.5/"


def test_no_network_address_when_only_loopback_or_unreadable():
    assert lan_address("http://localhost:8501/", ip="127.0.0.1") is None
    assert lan_address("http://localhost:8501/", ip="0.0.0.0") is None
    assert lan_address("http://localhost:8501/", ip="not an ip") is None


def test_detected_here_is_an_address_or_none():
    got = lan_address("http://localhost:8611/")
    assert got is None or (got.startswith("http://") and got.endswith(":8611/"))


def test_join_card_from_home_and_from_any_pages_sidebar(monkeypatch):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from app.join import PUBLIC_URL_ENV

    root = Path(__file__).resolve().parent.parent
    monkeypatch.setenv(PUBLIC_URL_ENV, "http://192.168.1.20:8501/")
    at = AppTest.from_file(str(root / "app" / "main.py"), default_timeout=120).run()
    assert not at.exception, at.exception
    at.button(key="home_join").click().run()  # Home's own button
    assert not at.exception, at.exception
    assert "http://192.168.1.20:8501/" in "\n".join(h.proto.body for h in at.get("html"))
    assert len(at.get("image")) == 1  # the QR code
    at.switch_page(str(root / "pages" / "recap.py")).run()  # any page: the sidebar's button
    at.button(key="sidebar_join").click().run()
    assert not at.exception, at.exception
    assert "http://192.168.1.20:8501/" in "\n".join(h.proto.body for h in at.get("html"))
