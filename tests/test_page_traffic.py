"""AppTest for pages/traffic.py: the example, pasted scrapes of each engine, every bad input, fetching from a
loopback server, the Live page's run, and the link."""

from __future__ import annotations

import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine.explain.traffic import compact_scrape

PAGE = str(Path(__file__).resolve().parent.parent / "pages" / "traffic.py")
FIX = Path(__file__).resolve().parent / "fixtures" / "traffic"
TIMEOUT = 60


def fx(name: str) -> str:
    return (FIX / name).read_text()


def _app(**query) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=TIMEOUT)
    for k, v in query.items():
        at.query_params[k] = str(v)
    return at.run()


def _metrics(at) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def _plain(md: str) -> str:
    """A message as the reader sees it: the page escapes Markdown (backslashes, zero-width spaces)."""
    return md.replace("\\", "").replace("\u200b", "")


def _errors(at) -> list[str]:
    return [_plain(e.value) for e in at.error]


def _paste(at, first: str, second: str = "") -> AppTest:
    at.text_area(key="yt_scrape").set_value(first)
    at.text_area(key="yt_scrape2").set_value(second)
    return at.run()


def _qp(at, key):
    v = at.query_params.get(key)
    return v[0] if isinstance(v, list) else v


def test_example_by_default():
    at = _app()
    assert not at.exception and not at.error
    m = _metrics(at)
    # the example: 2000 drafts, 6000 draft tokens, 3300 accepted, per position 1400, 1070, 830
    assert m["Acceptance rate"] == "0.550"
    assert m["Mean acceptance length"] == "2.65"
    assert m["α̂ (the analytic model's α)"] == "0.738"  # 3300 / (2000 + 1400 + 1070)
    assert m["γ the server ran"] == "3"
    codes = [c.value for c in at.code]
    assert any('"num_speculative_tokens": 7' in c for c in codes)
    assert any("--spec-draft-n-max 7 --spec-draft-n-min 7" in c for c in codes)
    assert any("longer than the 3 draft positions your server ran" in w.value for w in at.warning)  # γ = 7 is extrapolated
    assert _qp(at, "yt_scrape") is None  # the example is not put in the link


def test_pasted_llamacpp_pair_and_link():
    at = _paste(_app(), fx("llamacpp_before.txt"), fx("llamacpp_after.txt"))
    assert not at.exception and not at.error
    m = _metrics(at)
    assert m["Acceptance rate"] == "0.540"          # 1890 / 3500
    assert m["Mean acceptance length"] == "2.89"    # 1 + 1890 / 1000
    assert m["γ the server ran"] == "4"
    assert any("shorter than γ" in c.value for c in at.caption)  # 3500 < 1000 × 4
    # the link carries the speculative lines of both scrapes, which read back to the same page
    assert _qp(at, "yt_scrape") == compact_scrape(fx("llamacpp_before.txt"))
    again = _app(yt_scrape=_qp(at, "yt_scrape"), yt_scrape2=_qp(at, "yt_scrape2"))
    assert _metrics(again) == m


def test_sglang_says_there_is_no_per_position_data():
    at = _paste(_app(), fx("sglang_after.txt"))
    assert not at.exception and not at.error
    assert _metrics(at)["Mean acceptance length"] == "2.90"
    assert any("No per-position counts" in i.value for i in at.info)
    assert any("SGLang exposes only means" in _plain(c.value) for c in at.caption)


def test_two_models_ask_for_a_choice():
    at = _paste(_app(), fx("vllm_two_models.txt"))
    assert any("choose one" in e for e in _errors(at))
    at.selectbox(key="yt_model").set_value("qwen-7b").run()
    assert not at.error
    assert _metrics(at)["Acceptance rate"] == "0.400"  # 40 / 100
    assert _qp(at, "yt_model") == "qwen-7b"


@pytest.mark.parametrize("first,second,msg", [
    ("hello world foo", "", "not Prometheus text"),
    ('vllm:num_requests_running{model_name="m"} 3', "", "no speculative-decoding metrics"),
    ('vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 0', "", "Zero drafts"),
    ('vllm:spec_decode_num_drafts_total{model_name="m"} 10\n'
     'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 30\n'
     'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 12\n'
     'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3\n'
     'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 5', "", "not monotone"),
    (fx("vllm_after.txt"), fx("vllm_restarted.txt"), "went down"),
])
def test_bad_scrapes_show_a_message(first, second, msg):
    at = _paste(_app(), first, second)
    assert not at.exception
    assert any(msg in e for e in _errors(at)), _errors(at)


def test_empty_boxes_ask_for_a_scrape():
    at = _app()
    at.button(key="yt_btn_clear").click().run()
    assert any("Paste a scrape" in i.value for i in at.info)
    assert not at.metric
    at.button(key="yt_btn_example").click().run()
    assert _metrics(at)["Acceptance rate"] == "0.550"


def test_expensive_draft_says_decode_plainly():
    at = _app()
    at.slider(key="yt_cost").set_value(1.0).run()
    assert any("slower than plain decoding" in w.value for w in at.warning)


class _Metrics(BaseHTTPRequestHandler):
    def __init__(self, *a, body: str, **kw):
        self.body = body
        super().__init__(*a, **kw)

    def do_GET(self):  # noqa: N802
        data = self.body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_fetch_from_loopback_and_refusals():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Metrics, body=fx("vllm_after.txt")))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        at = _app()
        at.button(key="yt_btn_clear").click().run()
        at.text_input(key="yt_url").set_value(f"http://127.0.0.1:{srv.server_address[1]}/metrics").run()
        at.button(key="yt_btn_fetch2").click().run()  # into the second box: the page reads it alone
        assert any("Fetched" in s.value for s in at.success)
        assert not at.error
        assert _metrics(at)["Acceptance rate"] == "0.556"  # 5000 / 9000
        at.text_input(key="yt_url").set_value("http://example.com/metrics").run()
        at.button(key="yt_btn_fetch1").click().run()
        assert any("SPEEDUP_LAB_ALLOWED_HOSTS" in e for e in _errors(at))
        assert _metrics(at)["Acceptance rate"] == "0.556"  # the boxes keep what they had
    finally:
        srv.shutdown()
        srv.server_close()


def test_live_run_as_the_source(monkeypatch):
    from types import SimpleNamespace

    import engine.decoding.pass_cost as pass_cost

    # this machine's one-token pass for the toy target (its run drafts every round: no one-token pass of its own)
    monkeypatch.setattr(pass_cost, "machine_pass_cost", lambda target, measure=True: SimpleNamespace(ms={1: 2.0}))
    at = _app(yt_source="The Live page's last run")
    assert any("No speculative run" in i.value for i in at.info)
    from engine.decoding.proposers import DraftModelProposer
    from engine.decoding.sampling import SamplingConfig
    from engine.decoding.speculative import SpeculativeDecoder
    from tests.tiny_models import bigram_loaded, toy_cycle_table

    target = bigram_loaded(toy_cycle_table(8, 12.0))
    dec = SpeculativeDecoder(target, DraftModelProposer(bigram_loaded(toy_cycle_table(8, 4.0)), target), [2, 3],
                             gamma=3, sampling=SamplingConfig(temperature=1.0), seed=1, max_new_tokens=60,
                             stop_on_eos=False)
    dec.run()
    at.session_state["lv_dec"] = dec
    at.run()
    assert not at.exception and not at.error
    s = dec.stats()
    assert _metrics(at)["α̂ (the analytic model's α)"] == f"{s.acceptance_rate:.3f}"
    assert _metrics(at)["Acceptance rate"] == f"{s.accepted / s.drafted:.3f}"
    assert any("vllm:spec_decode_num_drafts_total" in c.value for c in at.code)
    # the model's c and s are the run's own (not the sliders' server defaults), and the words name the run
    from engine.explain.traffic import costs_from_run

    c, slope, _ = costs_from_run(s, dec.gamma, t1_ms=2.0)
    assert at.slider(key="yt_cost").value == pytest.approx(round(c, 2))
    assert at.slider(key="yt_slope").value == pytest.approx(round(slope, 2))
    assert any("this run's, as measured" in cap.value for cap in at.caption)
    assert "γ the run drafted" in _metrics(at) and "What the Live run measured" in [h.value for h in at.subheader]
    # the reader's own slider value stays on the next rerun of the same run
    at.slider(key="yt_cost").set_value(0.5).run()
    assert at.slider(key="yt_cost").value == 0.5


def test_pasted_text_is_not_rendered_as_markdown():
    evil = "[click me](http://evil.example)"
    text = (f'vllm:spec_decode_num_drafts_total{{model_name="{evil}"}} 10\n'
            'vllm:spec_decode_num_drafts_total{model_name="b"} 10\n')
    at = _paste(_app(), text)
    raw = [e.value for e in at.error]
    assert raw and all("[click me](http" not in r for r in raw)  # escaped: shown as text, not a link
    assert any(evil in e for e in _errors(at))


def test_llamacpp_panel_off_by_default_says_how_to_enable(monkeypatch):
    monkeypatch.delenv("SPEEDUP_LAB_LLAMACPP", raising=False)
    at = _app()
    texts = " ".join(_plain(i.value) for i in at.info)
    assert "SPEEDUP_LAB_LLAMACPP=1" in texts and "--llamacpp" in texts and "make serve-llamacpp" in texts
    assert not [b for b in at.button if b.label == "Start a local llama.cpp server"]


def test_llamacpp_panel_enabled_offers_start(monkeypatch):
    monkeypatch.setenv("SPEEDUP_LAB_LLAMACPP", "1")
    at = _app()
    assert [b for b in at.button if b.label == "Start a local llama.cpp server"]
    assert at.selectbox(key="yt_lc_spec").options == ["ngram-simple", "none"]


def test_pasted_vllm_response_json_and_trtllm():
    at = _app()
    at.text_area(key="yt_scrape").set_value(fx("vllm_response_summary.json"))
    at.text_area(key="yt_scrape2").set_value("")
    at.run()
    assert not at.exception and not at.error
    assert _metrics(at)["α̂ (the analytic model's α)"] == f"{74 / 94:.3f}"
    at.text_area(key="yt_scrape").set_value(fx("trtllm_before.txt"))
    at.text_area(key="yt_scrape2").set_value(fx("trtllm_after.txt"))
    at.run()
    assert not at.exception and not at.error
    m = _metrics(at)
    assert m["Acceptance rate"] == "0.600" and m["γ the server ran"] == "3" and m["Mean acceptance length"] == "2.80"
