"""URL query parameters: garbage falls back to the default, numbers are clamped."""

from streamlit.testing.v1 import AppTest


def _app():
    import streamlit as st

    from app.state import url_param

    st.write(repr(url_param("x", 0.5, float, lo=0.0, hi=1.0)))
    st.write(repr(url_param("n", 4, int, lo=1, hi=16)))
    st.write(repr(url_param("k", "a", str, choices=["a", "b"])))


def run(**params):
    at = AppTest.from_function(_app)
    for k, v in params.items():
        at.query_params[k] = v
    return [m.value for m in at.run().markdown]


def test_valid_values_pass():
    assert run(x="0.25", n="7", k="b") == ["0.25", "7", "'b'"]


def test_garbage_nan_inf_and_out_of_range():
    assert run(x="nan", n="abc", k="zzz") == ["0.5", "4", "'a'"]
    assert run(x="inf", n="999") == ["0.5", "16", "'a'"]
    assert run(x="-3", n="-5")[:2] == ["0.0", "1"]
    assert run(x="1e999", n="1e3")[:2] == ["0.5", "4"]


def test_a_value_another_page_left_in_the_session_is_checked_too():
    """Pages share one session state: a key set elsewhere to a value this page does not offer is seeded
    again (from the URL, else the default), not kept; a valid value is kept."""
    at = AppTest.from_function(_app)
    at.session_state["k"] = "NVIDIA A100 (a GPU name from another page)"
    at.query_params["k"] = "b"
    assert [m.value for m in at.run().markdown][2] == "'b'"
    at = AppTest.from_function(_app)
    at.session_state["k"] = "zzz"
    assert [m.value for m in at.run().markdown][2] == "'a'"
    at = AppTest.from_function(_app)
    at.session_state["k"] = "b"
    assert [m.value for m in at.run().markdown][2] == "'b'"


def _app_with_sync():
    import streamlit as st

    from app.state import sync_url, url_param

    url_param("x", 0.5, float, lo=0.0, hi=1.0)
    url_param("n", 4, int, lo=1, hi=16)
    url_param("k", "a", str, choices=["a", "b"])
    sync_url(["x", "n", "k"])


def test_replaced_link_values_are_named_once_in_a_toast():
    at = AppTest.from_function(_app_with_sync)
    for k, v in {"x": "1.5", "n": "abc", "k": "b"}.items():
        at.query_params[k] = v
    at.run()
    assert len(at.toast) == 1
    msg = at.toast[0].value
    assert "x=1.5 → 1" in msg and "n=abc → 4" in msg and "k=" not in msg  # k=b was valid
    at.run()
    assert len(at.toast) == 0  # once per session
    # a valid link (even written differently: 0.60 for 0.6) says nothing
    at = AppTest.from_function(_app_with_sync)
    at.query_params["x"] = "0.60"
    at.run()
    assert len(at.toast) == 0
