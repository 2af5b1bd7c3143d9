"""engine/explain/traffic.py: acceptance profiles of real exposition text, hand-computed metrics, bad input,
fetching from a loopback server, this engine's runs as vLLM counters (round trip), and the command line."""

from __future__ import annotations

import json
import math
import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from engine.errors import InputError
from engine.explain import traffic as tr
from engine.explain.analytic import expected_tokens_per_pass

FIX = Path(__file__).resolve().parent / "fixtures" / "traffic"


def fx(name: str) -> str:
    return (FIX / name).read_text()


# ------------------------------------------------------------------ vLLM


def test_vllm_single_scrape_sums_engines_of_one_model():
    p = tr.profile_from_text(fx("vllm_after.txt"))
    assert (p.engine, p.model) == ("vllm", "meta-llama/Llama-3.1-8B-Instruct")
    # engine 0 + engine 1 of the fixture
    assert (p.drafts, p.draft_tokens, p.accepted_tokens) == (3000, 9000, 5000)
    assert p.accepted_per_pos == (2100, 1620, 1280)
    assert p.acceptance_rate == pytest.approx(5000 / 9000)
    assert p.mean_acceptance_length == pytest.approx(1 + 5000 / 3000)
    assert p.survival == pytest.approx([0.7, 0.54, 1280 / 3000])
    assert p.conditional_alpha == pytest.approx([0.7, 1620 / 2100, 1280 / 1620])
    assert p.gamma == 3 and p.full_length_drafts
    assert p.judged == 3000 + 2100 + 1620  # position 0 of every draft, i + 1 after each kept token i
    assert p.alpha_hat == pytest.approx(5000 / 6720)
    assert any("2 vLLM engines" in n for n in p.notes)


def test_vllm_two_scrapes_difference_every_counter():
    p = tr.profile_from_scrapes(fx("vllm_before.txt"), fx("vllm_after.txt"))
    assert (p.drafts, p.draft_tokens, p.accepted_tokens) == (2000, 6000, 3300)
    assert p.accepted_per_pos == (1400, 1070, 830)
    assert p.window == "between the two scrapes"
    assert p.acceptance_rate == pytest.approx(0.55)
    assert p.mean_acceptance_length == pytest.approx(2.65)
    assert p.survival == pytest.approx([0.7, 0.535, 0.415])
    assert p.conditional_alpha == pytest.approx([0.7, 1070 / 1400, 830 / 1070])
    assert p.alpha_hat == pytest.approx(3300 / 4470)


def test_created_samples_are_not_counted():
    # the fixtures carry NAME_created samples (timestamps ~1.76e9): counting them would swamp every number
    assert "_created{" in fx("vllm_after.txt")
    assert tr.profile_from_text(fx("vllm_after.txt")).drafts == 3000


def test_two_models_need_a_choice():
    with pytest.raises(InputError, match=r"2 models \('llama-8b', 'qwen-7b'\): choose one"):
        tr.profile_from_text(fx("vllm_two_models.txt"))
    q = tr.profile_from_text(fx("vllm_two_models.txt"), model="qwen-7b")
    assert (q.drafts, q.draft_tokens, q.accepted_tokens, q.accepted_per_pos) == (50, 100, 40, (30, 10))
    with pytest.raises(InputError, match="No speculative metrics for model 'gpt'"):
        tr.profile_from_text(fx("vllm_two_models.txt"), model="gpt")


def test_restart_between_scrapes_is_named():
    with pytest.raises(InputError, match=r"went down.*vllm:spec_decode_num_drafts_total 3000 → 200.*restarted"):
        tr.profile_from_scrapes(fx("vllm_after.txt"), fx("vllm_restarted.txt"))


# ------------------------------------------------------------------ llama.cpp


def test_llamacpp_two_scrapes():
    p = tr.profile_from_scrapes(fx("llamacpp_before.txt"), fx("llamacpp_after.txt"))
    assert (p.engine, p.model) == ("llama.cpp", None)
    assert (p.drafts, p.draft_tokens, p.accepted_tokens) == (1000, 3500, 1890)
    assert p.accepted_per_pos == (770, 540, 360, 220)
    assert p.acceptance_rate == pytest.approx(0.54)
    assert p.mean_acceptance_length == pytest.approx(2.89)
    assert p.survival == pytest.approx([0.77, 0.54, 0.36, 0.22])
    assert p.conditional_alpha == pytest.approx([0.77, 540 / 770, 2 / 3, 220 / 360])
    # 3500 draft tokens in 1000 drafts of at most 4: some drafts were shorter, so judged is unknown and α̂
    # is the α whose E(α, 4) is the mean acceptance length
    assert not p.full_length_drafts and p.judged is None
    assert expected_tokens_per_pass(p.alpha_hat, 4) == pytest.approx(2.89, abs=1e-9)


def test_llamacpp_rounded_counters_are_noted():
    p = tr.profile_from_text(fx("llamacpp_large.txt"))
    assert p.drafts == 1234570  # "1.23457e+06": 6 significant digits
    assert p.accepted_per_pos[0] == 1034567  # the per-position counters are exact
    assert any("6 significant digits" in n for n in p.notes)


# ------------------------------------------------------------------ SGLang


def test_sglang_gauges_give_means_only():
    p = tr.profile_from_text(fx("sglang_after.txt"))
    assert (p.engine, p.model) == ("sglang", "Qwen/Qwen3-8B")
    assert not p.has_counts and not p.per_position and p.survival == [] and p.conditional_alpha == []
    assert p.mean_acceptance_length == pytest.approx(2.9)
    assert p.sglang_draft_tokens == pytest.approx(2.9 / 0.725)  # = 4 = --speculative-num-draft-tokens
    assert p.gamma == 3
    assert p.acceptance_rate == pytest.approx(1.9 / 3)  # (length − 1) ÷ γ, vLLM's definition
    assert expected_tokens_per_pass(p.alpha_hat, 3) == pytest.approx(2.9, abs=1e-9)
    assert any("no per-position" in n for n in p.notes)


def test_sglang_two_scrapes_use_the_second():
    p = tr.profile_from_scrapes(fx("sglang_before.txt"), fx("sglang_after.txt"))
    assert p.mean_acceptance_length == pytest.approx(2.9)
    assert any("not differenced" in n for n in p.notes)


# ------------------------------------------------------------------ bad input

def _vllm(drafts, dt, acc, per_pos, model="m"):
    lines = [f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="{model}"}} {drafts}',
             f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="{model}"}} {dt}',
             f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="{model}"}} {acc}']
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="{model}",position="{i}"}} '
              f'{v}' for i, v in per_pos.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text,msg", [
    ("", "empty"),
    ("hello world foo\n", "not Prometheus text"),
    ("<html><body>Not found</body></html>\n", "not Prometheus text"),
    ('vllm:num_requests_running{model_name="m"} 3\n', "no speculative-decoding metrics"),
    (_vllm(0, 0, 0, {0: 0}), "Zero drafts"),
    (_vllm(10, 30, 12, {0: 3, 1: 5, 2: 4}), "not monotone: position 1 has 5 .* position 0 only 3"),
    (_vllm(10, 30, 12, {0: 8, 2: 4}), r"lacks position\(s\) \[1\]"),
    (_vllm(10, 30, 40, {0: 10, 1: 10, 2: 10}), "More accepted tokens"),
    (_vllm(10, 30, 12, {0: 11}), "only 10 drafts"),
])
def test_bad_scrapes_raise_clear_errors(text, msg):
    with pytest.raises(InputError, match=msg):
        tr.profile_from_text(text)


def test_zero_drafts_between_two_scrapes():
    a = _vllm(10, 30, 12, {0: 6, 1: 4, 2: 2})
    with pytest.raises(InputError, match="Zero drafts .*between the two scrapes"):
        tr.profile_from_scrapes(a, a)


def test_scrapes_of_two_engines_refused():
    with pytest.raises(InputError, match="same server"):
        tr.profile_from_scrapes(fx("vllm_before.txt"), fx("llamacpp_after.txt"))


# ------------------------------------------------------------------ predictions


def test_tokens_per_pass_by_position_by_hand():
    assert tr.tokens_per_pass_measured([0.5, 0.4], 2) == pytest.approx(1 + 0.5 + 0.2)
    assert tr.tokens_per_pass_measured([0.5, 0.4], 3) == pytest.approx(1.7 + 0.2 * 0.4)  # last α repeated
    # one α everywhere is Eq. 1
    assert tr.tokens_per_pass_measured([0.8], 4) == pytest.approx(expected_tokens_per_pass(0.8, 4))
    with pytest.raises(InputError):
        tr.tokens_per_pass_measured([1.2], 2)


def test_predict_by_hand():
    p = tr.profile_from_scrapes(fx("vllm_before.txt"), fx("vllm_after.txt"))
    pr = tr.predict(p, c=0.05, slope=0.0)
    # at the measured γ = 3, E from the measured α_i is the mean acceptance length (every draft had 3 tokens)
    assert pr.tokens_measured[2] == pytest.approx(2.65)
    assert pr.tokens_measured[:3] == pytest.approx([1.7, 1 + 0.7 + 0.535, 2.65])
    a = 3300 / 4470
    assert pr.tokens_geometric[2] == pytest.approx(1 + a + a * a + a ** 3)
    assert pr.speedup_measured[2] == pytest.approx(2.65 / (3 * 0.05 + 1))
    assert pr.best_gamma_measured == 3 and pr.best_speedup_measured == pytest.approx(2.65 / 1.15)
    assert pr.extrapolated == [g > 3 for g in range(1, 17)]
    lo, hi = pr.speedup_interval
    assert lo < pr.best_speedup < hi
    assert sum(pr.best_gamma_share.values()) == pytest.approx(1.0)
    # a steep verify cost (s = 1) makes every extra token cost a full step: the best γ shortens
    assert tr.predict(p, c=0.05, slope=1.0).best_gamma < pr.best_gamma


def test_uncertainty_shrinks_with_more_drafts():
    small = tr.profile_from_text(_vllm(100, 300, 165, {0: 70, 1: 53, 2: 42}))
    big = tr.profile_from_text(_vllm(10000, 30000, 16500, {0: 7000, 1: 5300, 2: 4200}))
    w = [tr.predict(x).speedup_interval for x in (small, big)]
    assert (w[1][1] - w[1][0]) < (w[0][1] - w[0][0]) / 5  # 100× the drafts: about 10× narrower


def test_wilson_intervals_cover_the_estimate():
    p = tr.profile_from_scrapes(fx("vllm_before.txt"), fx("vllm_after.txt"))
    cis = tr.wilson_intervals(p)
    for (lo, hi), a, n in zip(cis, p.conditional_alpha, (2000, 1400, 1070)):
        assert lo < a < hi
        assert hi - lo == pytest.approx(2 * 1.96 * math.sqrt(a * (1 - a) / n), rel=0.05)


def test_settings_for_each_engine():
    s = {x.engine: x.flags for x in tr.settings_for(5)}
    assert s["vLLM"] == "--speculative-config '{\"num_speculative_tokens\": 5}'"
    assert json.loads(s["vLLM"].split("'")[1]) == {"num_speculative_tokens": 5}
    assert s["SGLang"] == "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6"
    assert s["llama.cpp"] == "--spec-draft-n-max 5 --spec-draft-n-min 5"
    with pytest.raises(InputError):
        tr.settings_for(0)


# ------------------------------------------------------------------ fetching (loopback only)


class _Handler(BaseHTTPRequestHandler):
    def __init__(self, *a, body: str, delay: float = 0.0, **kw):
        self.body, self.delay = body, delay
        super().__init__(*a, **kw)

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.delay:
            import time

            time.sleep(self.delay)
        if self.path == "/metrics":
            data = self.body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://example.com/metrics")
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *a):  # quiet
        pass


@pytest.fixture
def server():
    servers = []

    def start(body: str, delay: float = 0.0) -> str:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Handler, body=body, delay=delay))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_fetch_from_a_loopback_server(server):
    base = server(fx("vllm_after.txt"))
    text = tr.fetch_scrape(base + "/metrics", env={})
    assert text == fx("vllm_after.txt")
    assert tr.profile_from_text(text).drafts == 3000


def test_fetch_errors_are_clear(server):
    base = server(fx("vllm_after.txt"))
    with pytest.raises(InputError, match="answered HTTP 404"):
        tr.fetch_scrape(base + "/nope", env={})
    with pytest.raises(InputError, match="redirects to http://example.com/metrics"):
        tr.fetch_scrape(base + "/moved", env={})
    slow = server("x 1\n", delay=1.5)
    with pytest.raises(InputError, match="Nothing answered .* within 0.3 s"):
        tr.fetch_scrape(slow + "/metrics", timeout=0.3, env={})


def test_fetch_where_nothing_listens():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens on this port now
    with pytest.raises(InputError, match=f"Nothing answers at http://127.0.0.1:{port}/metrics"):
        tr.fetch_scrape(f"http://127.0.0.1:{port}/metrics", timeout=2.0, env={})


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/metrics", "http://127.9.9.9/metrics",
                                 "http://localhost:30000/metrics", "http://[::1]:8080/metrics"])
def test_loopback_is_allowed_by_default(url):
    assert tr.check_url(url, env={}) == url


@pytest.mark.parametrize("url,msg", [
    ("http://example.com/metrics", "only loopback .*SPEEDUP_LAB_ALLOWED_HOSTS.*'example.com' is not listed"),
    ("http://10.0.0.5:8000/metrics", "not listed"),
    ("http://127.0.0.1.nip.io/metrics", "not listed"),  # a name is not resolved: not loopback
    ("ftp://127.0.0.1/metrics", "http:// or https://"),
    ("127.0.0.1:8000/metrics", "http:// or https://"),
    ("http://127.0.0.1:99999/metrics", "cannot be read"),
])
def test_other_addresses_are_refused(url, msg):
    with pytest.raises(InputError, match=msg):
        tr.check_url(url, env={})


def test_operator_can_allow_hosts():
    env = {tr.ALLOWED_HOSTS_ENV: "gpu-box, metrics.internal:9400"}
    assert tr.check_url("http://gpu-box:8000/metrics", env=env)
    assert tr.check_url("http://metrics.internal:9400/metrics", env=env)
    with pytest.raises(InputError):
        tr.check_url("http://metrics.internal:9999/metrics", env=env)  # listed with another port only


# ------------------------------------------------------------------ this engine's runs


@pytest.fixture(scope="module")
def run_decoder():
    """A sampled run on the toy bigram pair (target more peaked than the draft): a mix of kept and
    rejected draft tokens at every position."""
    from engine.decoding.proposers import DraftModelProposer
    from engine.decoding.sampling import SamplingConfig
    from engine.decoding.speculative import SpeculativeDecoder
    from tests.tiny_models import bigram_loaded, toy_cycle_table

    target = bigram_loaded(toy_cycle_table(8, 12.0))
    draft = bigram_loaded(toy_cycle_table(8, 4.0))
    dec = SpeculativeDecoder(target, DraftModelProposer(draft, target), [2, 3], gamma=4,
                             sampling=SamplingConfig(temperature=1.0), seed=3, max_new_tokens=120,
                             stop_on_eos=False)
    dec.run()
    return dec


def test_run_stats_count_drafts_and_positions(run_decoder):
    s = run_decoder.stats()
    rounds = run_decoder.rounds
    assert s.drafts == sum(1 for r in rounds if r.n_drafted)
    assert sum(s.accepted_at_position) == s.accepted
    assert s.accepted_at_position == [sum(1 for r in rounds if r.n_accepted > i)
                                      for i in range(len(s.accepted_at_position))]
    assert sum(s.judged_at_position) == s.judged
    assert [k / n for k, n in zip(s.accepted_at_position, s.judged_at_position)] == \
        pytest.approx(s.acceptance_by_position)
    assert 0 < s.accepted < s.judged  # not a vacuous run


def test_run_profile_and_round_trip_through_prometheus(run_decoder):
    s = run_decoder.stats()
    p = tr.profile_from_run(run_decoder)
    assert (p.drafts, p.draft_tokens, p.accepted_tokens) == (s.drafts, s.drafted, s.accepted)
    assert p.accepted_per_pos == tuple(s.accepted_at_position) and len(p.accepted_per_pos) == 4
    assert p.alpha_hat == pytest.approx(s.acceptance_rate)  # judged counts known: the run's own α̂
    text = tr.run_to_prometheus(p, model_name="toy")
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in text and "_created{" in text
    back = tr.profile_from_text(text)
    assert back.engine == "vllm" and back.model == "toy"
    assert (back.drafts, back.draft_tokens, back.accepted_tokens, back.accepted_per_pos) == \
        (p.drafts, p.draft_tokens, p.accepted_tokens, p.accepted_per_pos)
    assert back.acceptance_rate == pytest.approx(s.accepted / s.drafted)


def test_run_profile_from_generate_json_with_and_without_new_fields(run_decoder):
    s = run_decoder.stats()
    data = {"stats": s.to_dict(), "rounds": [r.to_dict() for r in run_decoder.rounds],
            "settings": {"gamma": 4, "target": "toy"}}
    new = tr.profile_from_json(json.dumps(data))
    for key in ("drafts", "accepted_at_position", "judged_at_position"):
        del data["stats"][key]
    old = tr.profile_from_run(data)  # counted from the rounds
    assert new.counts_dict() == old.counts_dict()
    assert new.judged_per_pos == old.judged_per_pos
    assert new.model == "toy"


def test_plain_run_has_zero_drafts():
    from engine.decoding.trace import run_stats

    s = run_stats([], 0.0, 0.0)
    with pytest.raises(InputError, match="Zero drafts"):
        tr.profile_from_run(s)
    text = tr.run_metrics_text(s, None, "m")  # --metrics-out still writes zero counters
    with pytest.raises(InputError, match="Zero drafts"):
        tr.profile_from_text(text)


# ------------------------------------------------------------------ command line


def test_cli_traffic_json(capsys):
    from engine.__main__ import main

    rc = main(["traffic", str(FIX / "vllm_before.txt"), str(FIX / "vllm_after.txt"), "--json",
               "--draft-cost", "0.05"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("engine", "drafts", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
                "survival", "conditional_alpha", "best_gamma"):
        assert key in out
    assert out["engine"] == "vllm" and out["drafts"] == 2000
    assert out["acceptance_rate"] == pytest.approx(0.55)
    assert out["survival"] == pytest.approx([0.7, 0.535, 0.415])
    assert out["best_gamma"] == tr.predict(tr.profile_from_scrapes(fx("vllm_before.txt"),
                                                                   fx("vllm_after.txt"))).best_gamma


def test_cli_traffic_text_and_stdin(capsys, monkeypatch):
    import io

    from engine.__main__ import main

    monkeypatch.setattr("sys.stdin", io.StringIO(fx("llamacpp_after.txt")))
    assert main(["traffic", "-"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp server" in out and "conditional α_i" in out and "--spec-draft-n-max" in out


@pytest.mark.parametrize("args,msg", [
    (["vllm_two_models.txt"], "choose one"),
    (["vllm_after.txt", "vllm_restarted.txt"], "went down"),
    (["missing.txt"], "Cannot read"),
])
def test_cli_traffic_errors_exit_2(capsys, args, msg):
    from engine.__main__ import main

    assert main(["traffic", *[str(FIX / a) for a in args]]) == 2
    assert msg in capsys.readouterr().err


def test_generate_metrics_out_round_trip(tmp_path, capsys):
    """Our run → vLLM-named Prometheus text (generate --metrics-out) → traffic: the run's own counts."""
    from engine.__main__ import main
    from tests.tiny_models import save_tiny_llama

    model = str(save_tiny_llama(tmp_path / "m", vocab_size=32, layers=2))
    metrics = tmp_path / "run.prom"
    assert main(["generate", "--prompt", "w1 w2 w3 w1 w2 w3 w1", "--target", model, "--draft", "ngram",
                 "--gamma", "3", "--max-new-tokens", "16", "--json", "--no-chat",
                 "--metrics-out", str(metrics)]) == 0
    run = json.loads(capsys.readouterr().out)
    st = run["stats"]
    assert main(["traffic", str(metrics), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "vllm" and out["model"] == model
    assert (out["drafts"], out["draft_tokens"], out["accepted_tokens"]) == (st["drafts"], st["drafted"], st["accepted"])
    assert out["accepted_per_pos"] == st["accepted_at_position"] + [0] * (3 - len(st["accepted_at_position"]))
    # the run's --json output itself reads as the same profile
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert main(["traffic", str(tmp_path / "run.json"), "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["drafts"] == out["drafts"] and same["accepted_per_pos"] == out["accepted_per_pos"]


# ------------------------------------------------------------------ what the page uses


def test_compact_scrape_keeps_only_speculative_lines_and_reads_the_same():
    full = fx("vllm_after.txt")
    small = tr.compact_scrape(full)
    assert "_created" not in small and "# HELP" not in small and "num_requests_running" not in small
    assert len(small) < len(full) / 3
    assert tr.profile_from_text(small).counts_dict() == tr.profile_from_text(full).counts_dict()
    assert tr.compact_scrape("hello") == ""


def test_list_models():
    assert tr.list_models(fx("vllm_two_models.txt")) == ["llama-8b", "qwen-7b"]
    assert tr.list_models(fx("llamacpp_after.txt")) == []  # llama.cpp has no model label
    assert tr.list_models(fx("sglang_after.txt")) == ["Qwen/Qwen3-8B"]


def test_example_scrapes_are_vllm_text_with_hand_counts():
    a, b = tr.example_scrapes()
    p = tr.profile_from_scrapes(a, b)
    assert (p.engine, p.drafts, p.draft_tokens, p.accepted_tokens, p.accepted_per_pos) == \
        ("vllm", 2000, 6000, 3300, (1400, 1070, 830))


def test_position_view_by_hand():
    v = tr.position_view(tr.profile_from_scrapes(fx("vllm_before.txt"), fx("vllm_after.txt")))
    a = 3300 / 4470
    assert v.positions == [0, 1, 2] and v.kept == [1400, 1070, 830] and v.reached == [2000, 1400, 1070]
    assert v.survival_geometric == pytest.approx([a, a * a, a ** 3])
    assert all(lo < c < hi for lo, c, hi in zip(v.ci_low, v.conditional, v.ci_high))
    assert tr.position_view(tr.profile_from_text(fx("sglang_after.txt"))) is None


def test_sglang_predictions_past_its_gamma_are_extrapolated():
    p = tr.profile_from_text(fx("sglang_after.txt"))
    pr = tr.predict(p)
    assert pr.measured_positions == 3 and pr.extrapolated == [g > 3 for g in range(1, 17)]
    assert pr.tokens_measured == pytest.approx(pr.tokens_geometric)  # one α: both curves are the geometric one
    assert pr.tokens_measured[2] == pytest.approx(2.9)
    assert pr.speedup_interval is None and pr.best_gamma_share == {}  # no counts, no uncertainty
    assert pr.best_is_extrapolated and pr.best_gamma_measured == 3


# ------------------------------------------------------------------ SGLang verify calls, TensorRT-LLM, vLLM per request


def test_sglang_verify_calls_give_tokens_per_pass():
    p = tr.profile_from_scrapes(fx("sglang_verify_before.txt"), fx("sglang_verify_after.txt"))
    # hand: Δgeneration 95121 − 81234 = 13887, Δverify 34629 − 30000 = 4629 → 3.0 tokens per pass
    assert (p.generation_tokens, p.verify_calls) == (13887, 4629)
    assert p.tokens_per_pass_counter == pytest.approx(3.0)
    assert p.mean_acceptance_length == pytest.approx(3.0)
    assert p.gamma == 3  # gauges of the second scrape: 2.9 ÷ 0.725 = 4 draft tokens → γ = 3
    # α with 1 + α + α² + α³ = 3
    assert 1 + p.alpha_hat + p.alpha_hat ** 2 + p.alpha_hat ** 3 == pytest.approx(3.0)
    assert p.window == "between the two scrapes"
    assert any("first token" in n for n in p.notes)


def test_sglang_verify_single_scrape_and_restart():
    p = tr.profile_from_text(fx("sglang_verify_after.txt"))
    assert p.tokens_per_pass_counter == pytest.approx(95121 / 34629)
    with pytest.raises(InputError, match="went down.*spec_verify_calls_total 34629 → 30000"):
        tr.profile_from_scrapes(fx("sglang_verify_after.txt"), fx("sglang_verify_before.txt"))


def test_sglang_without_verify_counter_is_unchanged():
    p = tr.profile_from_text(fx("sglang_after.txt"))
    assert p.verify_calls is None and p.tokens_per_pass_counter is None
    assert p.mean_acceptance_length == pytest.approx(2.9)


def test_trtllm_two_scrapes_by_hand():
    p = tr.profile_from_scrapes(fx("trtllm_before.txt"), fx("trtllm_after.txt"))
    assert (p.engine, p.model) == ("tensorrt-llm", "nvidia/Llama-3.1-8B-Instruct-FP8")
    assert (p.draft_tokens, p.accepted_tokens, p.drafts) == (12000, 7200, None)
    assert p.acceptance_rate == pytest.approx(0.6)          # 7200 ÷ 12000
    assert p.gamma == 3                                      # round((2.75 − 1) ÷ 0.6) = round(2.917)
    assert p.mean_acceptance_length == pytest.approx(2.8)   # 1 + 0.6 × 3
    assert expected_tokens_per_pass(p.alpha_hat, 3) == pytest.approx(2.8, abs=1e-9)
    assert p.draft_overhead_gauge == pytest.approx(0.12)
    assert not p.per_position
    pred = tr.predict(p)
    assert pred.measured_positions == 3 and pred.speedup_interval is None
    assert tr.detect_engine(fx("trtllm_after.txt")) == "tensorrt-llm"


def test_trtllm_single_scrape_and_zero_traffic():
    p = tr.profile_from_text(fx("trtllm_before.txt"))
    assert p.acceptance_rate == pytest.approx(0.5) and p.gamma == 3  # round(1.5 ÷ 0.5)
    with pytest.raises(InputError, match="Zero draft tokens"):
        tr.profile_from_scrapes(fx("trtllm_after.txt"), fx("trtllm_after.txt"))


def test_vllm_response_summary_by_hand():
    p = tr.profile_from_input(fx("vllm_response_summary.json"))
    assert (p.engine, p.drafts, p.draft_tokens, p.accepted_tokens) == ("vllm", 40, 120, 74)
    assert p.accepted_per_pos == (30, 24, 20)                # Σ_{j>i} [10, 6, 4, 20]
    assert p.judged_per_pos == (40, 30, 24)                  # every draft 3 long: judged up to the first miss
    assert p.alpha_hat == pytest.approx(74 / 94)
    assert p.mean_acceptance_length == pytest.approx(2.85)   # the response's own field
    assert p.acceptance_rate == pytest.approx(0.6166666666666667)


def test_vllm_response_detailed_variable_lengths_by_hand():
    p = tr.profile_from_vllm_responses(fx("vllm_response_detailed.json"))
    assert p.accepted_per_pos == (4, 2, 1)
    # (drafted, kept): (3,3) judges 0,1,2; (3,0) 0; (2,2) 0,1; (1,1) 0; (3,1) 0,1
    assert p.judged_per_pos == (5, 3, 1)
    assert p.alpha_hat == pytest.approx(7 / 9)
    assert not p.full_length_drafts


def test_vllm_responses_summed_and_streamed():
    p = tr.profile_from_input(fx("vllm_responses.jsonl"))
    assert (p.drafts, p.draft_tokens, p.accepted_tokens) == (45, 132, 81)
    assert p.accepted_per_pos == (34, 26, 21) and p.judged_per_pos == (45, 33, 25)
    assert p.alpha_hat == pytest.approx(81 / 103)
    sse = "".join(f"data: {ln}\n\n" for ln in fx("vllm_responses.jsonl").splitlines()) + "data: [DONE]\n\n"
    assert tr.profile_from_input(sse).counts_dict() == p.counts_dict()
    as_list = json.dumps([json.loads(ln) for ln in fx("vllm_responses.jsonl").splitlines()])
    assert tr.profile_from_input(as_list).counts_dict() == p.counts_dict()


@pytest.mark.parametrize("text,msg", [
    ('{"choices": [], "metrics": {"speculative_decoding": null}}', "No metrics.speculative_decoding"),
    ('{"metrics": {"speculative_decoding": {"num_spec_steps": 3, "num_draft_tokens": 6, "num_accepted_draft_tokens": 2,'
     ' "num_spec_tokens": 2, "acceptance_histogram": [1, 1, 0]}}}', "does not add up"),
    ('{"metrics": {"speculative_decoding": {"num_spec_steps": 2, "num_draft_tokens": 6, "num_accepted_draft_tokens": 2,'
     ' "num_spec_tokens": 3, "acceptance_histogram": [1, 1]}}}', "num_spec_tokens \\+ 1 = 4"),
])
def test_vllm_response_errors(text, msg):
    with pytest.raises(InputError, match=msg):
        tr.profile_from_input(text)


def test_cli_reads_trtllm_and_vllm_json(capsys):
    from engine.__main__ import main

    assert main(["traffic", str(FIX / "trtllm_before.txt"), str(FIX / "trtllm_after.txt"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "tensorrt-llm" and out["acceptance_rate"] == pytest.approx(0.6) and out["gamma"] == 3
    assert main(["traffic", str(FIX / "vllm_response_summary.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["alpha_hat"] == pytest.approx(74 / 94) and out["accepted_per_pos"] == [30, 24, 20]
    assert main(["traffic", str(FIX / "sglang_verify_before.txt"), str(FIX / "sglang_verify_after.txt")]) == 0
    assert "tokens per target pass = 3.000" in capsys.readouterr().out


def test_costs_from_run_by_hand():
    """c = draft ms a token ÷ t(1); s = (t(γ+1)/t(1) − 1) ÷ γ; t(1) the run's own, else the one given."""
    from types import SimpleNamespace

    from engine.explain.traffic import costs_from_run

    run = SimpleNamespace(draft_ms_per_token=1.4, verify_ms_by_tokens={1: 7.0, 3: 9.1})
    c, s, where = costs_from_run(run, 2)
    assert c == pytest.approx(0.2) and s == pytest.approx((9.1 / 7.0 - 1) / 2)  # 0.15
    assert "run's own" in where and "3 tokens" in where
    # no one-token pass in the run: the machine's t(1); no pass over γ + 1 tokens: s = 0
    c, s, where = costs_from_run(SimpleNamespace(draft_ms_per_token=2.0, verify_ms_by_tokens={2: 8.0}), 3, t1_ms=8.0)
    assert c == pytest.approx(0.25) and s == 0.0 and "pass-cost curve" in where
    # clipped to the sliders' [0, 1]
    c, s, _ = costs_from_run(SimpleNamespace(draft_ms_per_token=20.0, verify_ms_by_tokens={1: 5.0, 2: 20.0}), 1)
    assert (c, s) == (1.0, 1.0)
    for bad in (SimpleNamespace(draft_ms_per_token=None, verify_ms_by_tokens={1: 5.0}),
                SimpleNamespace(draft_ms_per_token=1.0, verify_ms_by_tokens={})):
        with pytest.raises(InputError):
            costs_from_run(bad, 2)
    with pytest.raises(InputError):
        costs_from_run(run, 0)
