"""URL query parameters: garbage falls back to the default, numbers are clamped."""

from pathlib import Path

from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parent.parent


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


def _app_with_step():
    import streamlit as st

    from app.state import sync_url, url_param

    st.write(repr(url_param("a", 0.8, float, lo=0.0, hi=1.0, step=0.01)))
    st.write(repr(url_param("t", 0.0, float, lo=0.0, hi=2.0, step=0.05)))
    sync_url(["a", "t"])


def test_a_value_between_slider_steps_is_rounded_to_the_step_shown():
    # α = 0.805 was used as such while its slider showed 0.81; T = 0.33 on a 0.05 grid → 0.35
    at = AppTest.from_function(_app_with_step)
    at.query_params["a"] = "0.805"
    at.query_params["t"] = "0.33"
    at.run()
    assert [m.value for m in at.markdown] == ["0.81", "0.35"]
    assert "a=0.805 → 0.81" in at.toast[0].value
    at = AppTest.from_function(_app_with_step)
    at.query_params["a"] = "0.6"
    at.run()
    assert at.markdown[0].value == "0.6" and not at.toast


def _app_with_hidden_widget():
    import streamlit as st

    from app.state import sync_url, url_param

    url_param("x", 0.5, float, lo=0.0, hi=1.0)
    if st.session_state.get("show", True):  # like a What-if tab that is not open in this run
        st.slider("x", 0.0, 1.0, key="x")
    sync_url(["x"])


def test_a_value_survives_runs_where_its_widget_is_not_drawn():
    """Streamlit drops a widget's value when a run does not draw it (What-if's closed tabs reset, and the
    link lost the value); url_param re-asserts it every run."""
    at = AppTest.from_function(_app_with_hidden_widget).run()
    at.slider(key="x").set_value(0.3).run()
    at.session_state["show"] = False
    at.run()
    assert at.session_state["x"] == 0.3 and at.query_params["x"] == "0.3"
    at.session_state["show"] = True
    at.run()
    assert at.slider(key="x").value == 0.3


def test_a_url_changed_from_outside_wins_and_a_missing_key_keeps_the_value():
    """Back/Forward or an edited link changes the URL behind the page: the page follows it (Back undoes the
    last change). A key missing from the URL (the page opened from the sidebar) keeps the session's value."""
    at = AppTest.from_function(_app_with_hidden_widget).run()
    at.slider(key="x").set_value(0.3).run()
    assert at.query_params["x"] == "0.3"
    at.query_params["x"] = "0.5"  # Back: the URL before the change
    at.run()
    assert at.slider(key="x").value == 0.5
    del at.query_params["x"]  # opened again from the sidebar: no query string
    at.slider(key="x").set_value(0.7).run()
    del at.query_params["x"]
    at.run()
    assert at.slider(key="x").value == 0.7 and at.query_params["x"] == "0.7"


def _app_in_a_batch():
    import streamlit as st

    from app.state import begin_url_batch, flush_url, sync_url, url_param

    begin_url_batch(st.session_state.get("page", "p"))  # as app/main.py does, with the page's name
    try:
        url_param("x", 0.5, float, lo=0.0, hi=1.0)
        st.slider("x", 0.0, 1.0, key="x")
        st.button("other")
        sync_url(["x"])
    finally:
        flush_url()


def test_a_click_with_an_older_url_keeps_the_value_and_back_follows_the_url(monkeypatch):
    """A user's double click on "Previous request" moved one step or none: the second click's run came
    with the browser's URL from before the first click's update, and that older value was read as an
    outside change (Back) and undid both clicks. Only Back/Forward or another page follows the URL."""
    import app.state

    at = AppTest.from_function(_app_in_a_batch).run()
    at.slider(key="x").set_value(0.3).run()
    assert at.query_params["x"] in ("0.3", ["0.3"])
    at.query_params["x"] = "0.5"          # the URL the browser had before that run's update
    at.button[0].click().run()            # a click on the same page
    assert at.slider(key="x").value == 0.3 and at.query_params["x"] in ("0.3", ["0.3"])
    monkeypatch.setattr(app.state, "_is_history_navigation", lambda: True)
    at.query_params["x"] = "0.5"          # Back: the URL before the change
    at.run()
    assert at.slider(key="x").value == 0.5
    monkeypatch.setattr(app.state, "_is_history_navigation", lambda: False)
    at.slider(key="x").set_value(0.2).run()
    at.query_params["x"] = "0.9"          # a link from another page to this one, with its own x
    at.session_state["page"] = "q"
    at.run()
    assert at.slider(key="x").value == 0.9


def test_the_running_streamlit_says_whether_back_started_a_run():
    """``begin_url_batch`` relies on Streamlit's run context naming history navigation (Streamlit 1.67);
    without it every run would follow the URL again and a quick second click could be undone."""
    from streamlit.runtime.scriptrunner_utils.script_run_context import ScriptRunContext

    assert "is_history_navigation" in ScriptRunContext.__dataclass_fields__


def test_a_yes_no_value_that_is_neither_is_replaced_and_named():
    def app():
        import streamlit as st

        from app.state import sync_url, url_param

        st.write(repr(url_param("causal", False, bool)))
        sync_url(["causal"])

    for raw, shown in (("1", "True"), ("off", "False"), ("maybe", "False")):
        at = AppTest.from_function(app)
        at.query_params["causal"] = raw
        at.run()
        assert at.markdown[0].value == shown
        assert bool(at.toast) == (raw == "maybe")  # only the unreadable one is named


def test_a_page_that_stops_on_an_error_still_writes_its_link():
    """A user's report: after 65 query heads over 8 KV heads (an error, then st.stop) the link still said
    64, and choosing "Any draft model" (an error until one is typed) left lv_draft=head in the link:
    Streamlit drops what a script sends after st.stop(), so pages stop through stop_page."""
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=200)
    at.run()
    at.switch_page("../pages/kv_cache.py").run()
    at.selectbox(key="preset").set_value("Llama-3.1-70B").run()
    at.slider(key="heads").set_value(65).run()
    assert at.error and "65" in at.error[0].value
    assert at.query_params["heads"] in ("65", ["65"])
