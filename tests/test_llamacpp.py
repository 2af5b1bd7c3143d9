"""engine/serving/llamacpp.py without building anything: command lines, checks, errors, bounded requests."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from engine.serving import llamacpp as L


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDUP_LAB_CACHE", str(tmp_path))
    monkeypatch.delenv(L.SERVER_ENV, raising=False)
    monkeypatch.delenv(L.SDIST_ENV, raising=False)
    return tmp_path


def test_install_root_is_in_the_user_cache(cache):
    assert L.install_root() == cache / "llama.cpp-0.3.36"
    assert L.built_binary() == cache / "llama.cpp-0.3.36" / "build" / "bin" / "llama-server"


def test_command_ngram_simple():
    cmd = L.server_command("/b/llama-server", "/m.gguf", L.ServerConfig(port=8123, threads=2))
    assert cmd[:3] == ["/b/llama-server", "-m", "/m.gguf"]
    s = " ".join(cmd)
    assert "--host 127.0.0.1 --port 8123 --metrics -t 2" in s
    assert "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8" in s


def test_command_none_has_no_speculation():
    cmd = L.server_command("srv", "m.gguf", L.ServerConfig(spec_type="none"))
    assert "--spec-type" not in cmd and "-md" not in cmd and "--metrics" in cmd


def test_command_draft_simple(tmp_path):
    d = tmp_path / "d.gguf"
    d.write_bytes(b"x")
    cmd = L.server_command("srv", "m.gguf", L.ServerConfig(spec_type="draft-simple", draft_model=str(d), draft_max=5))
    s = " ".join(cmd)
    assert f"--spec-type draft-simple -md {d} --spec-draft-n-max 5" in s


@pytest.mark.parametrize("cfg, msg", [
    (L.ServerConfig(spec_type="eagle"), "Unknown speculation type 'eagle'"),
    (L.ServerConfig(port=80), "port must be 1024"),
    (L.ServerConfig(threads=0), "Threads must be"),
    (L.ServerConfig(spec_type="draft-simple"), "needs a draft model as a GGUF"),
    (L.ServerConfig(spec_type="draft-simple", draft_model="/no/such.gguf"), "is not a file"),
])
def test_bad_config(cfg, msg):
    with pytest.raises(L.LlamaCppError, match=msg):
        cfg.validate()


def test_port_in_use_and_start_refuses_it(cache):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert L.port_in_use(port)
        with pytest.raises(L.LlamaCppError, match=f"Port {port} on 127.0.0.1 is in use"):
            L.start_server(L.ServerConfig(port=port), binary="/nonexistent", model="/nonexistent")
    assert not L.port_in_use(L.free_port())


def test_find_needs_a_finished_build_with_the_same_options(cache):
    assert L.find_llama_server() is None
    b = L.built_binary()
    b.parent.mkdir(parents=True)
    b.write_text("#!/bin/sh\n")
    b.chmod(0o755)
    assert L.find_llama_server() is None  # no stamp: an interrupted build
    (L.install_root() / "build.json").write_text(json.dumps(L._build_stamp()))
    assert L.find_llama_server() == b
    stamp = dict(L._build_stamp(), cmake_options=["-DGGML_NATIVE=OFF"])
    (L.install_root() / "build.json").write_text(json.dumps(stamp))
    assert L.find_llama_server() is None  # built with other options


def test_x86_builds_leave_out_ggml_amx_kernels(monkeypatch):
    """ggml's AMX kernels crashed llama-server on AMX Xeons (ggml-org/llama.cpp#20824): x86 builds pass -mno-amx-*
    for C and C++ (and so a build made without them is rebuilt: the stamp holds the options); others do not."""
    monkeypatch.setattr(L.platform, "machine", lambda: "x86_64")
    opts = L.cmake_options()
    assert opts[:len(L.CMAKE_OPTIONS)] == L.CMAKE_OPTIONS
    for lang in ("C", "CXX"):
        flag = next(o for o in opts if o.startswith(f"-DCMAKE_{lang}_FLAGS="))
        assert all(f"-mno-amx-{x}" in flag for x in ("tile", "int8", "bf16"))
    assert L._build_stamp()["cmake_options"] == list(opts)
    monkeypatch.setattr(L.platform, "machine", lambda: "aarch64")
    assert L.cmake_options() == L.CMAKE_OPTIONS


def test_server_env_overrides(cache, monkeypatch, tmp_path):
    monkeypatch.setenv(L.SERVER_ENV, str(tmp_path / "missing"))
    with pytest.raises(L.LlamaCppError, match="not an executable file"):
        L.find_llama_server()


def test_no_toolchain_is_a_clear_error(cache, monkeypatch):
    monkeypatch.setattr(L.shutil, "which", lambda name: None)
    with pytest.raises(L.LlamaCppError, match="cmake.*not found.*build-essential cmake"):
        L.build_llama_server(progress=lambda m: None)


def test_sdist_hash_is_checked(cache, monkeypatch, tmp_path):
    fake = tmp_path / "fake.tar.gz"
    fake.write_bytes(b"not the sdist")
    monkeypatch.setenv(L.SDIST_ENV, str(fake))
    with pytest.raises(L.LlamaCppError, match="SHA-256"):
        L.fetch_sdist(progress=lambda m: None)


def test_build_failure_names_the_log(cache, monkeypatch, tmp_path):
    src = L.install_root() / "src" / L.VENDOR_DIR
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("this is not cmake(\n")
    (L.install_root() / "src" / ".complete").touch()
    monkeypatch.setattr(L, "fetch_sdist", lambda progress: tmp_path / "unused")
    lines = []
    with pytest.raises(L.LlamaCppError, match=r"Building llama-server failed .*build\.log"):
        L.build_llama_server(progress=lines.append, jobs=1)
    assert "CMakeLists.txt" in L.build_log_path().read_text()
    assert any("log:" in ln for ln in lines)


class _Fake(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):  # noqa: N802
        n = int(self.headers["Content-Length"])
        body = json.loads(self.rfile.read(n))
        _Fake.calls += 1
        out = json.dumps({"content": "ok", "tokens_predicted": body["n_predict"],
                          "timings": {"draft_n": 4, "draft_n_accepted": 3}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


def test_send_requests_is_bounded_and_loopback_only():
    srv = HTTPServer(("127.0.0.1", 0), _Fake)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        _Fake.calls = 0
        seen = []
        out = L.send_requests(url, 3, max_tokens=7, progress=lambda i, n: seen.append((i, n)))
        assert _Fake.calls == 3 and [r["tokens"] for r in out] == [7, 7, 7]
        assert seen == [(1, 3), (2, 3), (3, 3)] and out[0]["draft_n_accepted"] == 3
        stop = iter([False, True])
        assert len(L.send_requests(url, 5, should_stop=lambda: next(stop))) == 1
        with pytest.raises(L.LlamaCppError, match="Send 1–64 requests"):
            L.send_requests(url, 65)
        with pytest.raises(L.LlamaCppError, match="Tokens per request"):
            L.send_requests(url, 1, max_tokens=0)
    finally:
        srv.shutdown()
    with pytest.raises(L.LlamaCppError, match="loopback"):
        L.send_requests("http://example.com:8080", 1)


def test_cli_unknown_spec_type_exits_2(capsys):
    from engine.__main__ import main

    assert main(["serve-llamacpp", "--spec-type", "eagle"]) == 2
    assert "Unknown speculation type 'eagle'" in capsys.readouterr().err


def test_extract_takes_only_vendor_llamacpp(cache, tmp_path):
    import io
    import tarfile

    arc = tmp_path / "sdist.tar.gz"
    with tarfile.open(arc, "w:gz") as tf:
        for name, data in ((f"{L.VENDOR_DIR}/CMakeLists.txt", b"project(x)\n"),
                           (f"{L.VENDOR_DIR}/tools/server/server.cpp", b"int main(){}\n"),
                           ("llama_cpp_python-0.3.36/llama_cpp/llama.py", b"python\n")):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    src = L.extract_sources(arc, progress=lambda m: None)
    assert src == L.install_root() / "src" / L.VENDOR_DIR
    assert (src / "tools" / "server" / "server.cpp").stat().st_mtime == 1_700_000_000  # file times kept
    assert not (L.install_root() / "src" / "llama_cpp_python-0.3.36" / "llama_cpp").exists()
    assert L.extract_sources(arc, progress=lambda m: 1 / 0) == src  # once
