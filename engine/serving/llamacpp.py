"""llama.cpp's ``llama-server``, built once from a PyPI source distribution and run on the embedded GGUF.

One job: give the app and the command line a real serving engine with speculative decoding and Prometheus
metrics on this machine, so "Your traffic" reads real counters.

Where the code comes from: the MIT-licensed llama.cpp sources vendored in the source distribution of
``llama-cpp-python`` ``LLAMA_CPP_PYTHON_VERSION`` on PyPI (``vendor/llama.cpp``; licence ``LICENSE``, "MIT
License, Copyright (c) 2023-2026 The ggml authors"). It is fetched with ``pip download --no-deps
--no-binary :all: llama-cpp-python==0.3.36`` (nothing else is downloaded; the file's SHA-256 is checked) and
only the ``llama-server`` target is built with cmake, Release, CPU only (no CUDA, no OpenSSL, no web UI and no
UI download, no tests or examples), into ``engine.decoding.models.cache_root() / "llama.cpp-0.3.36"``:

- ``src/llama_cpp_python-0.3.36/vendor/llama.cpp``: the extracted sources; ``build/``: cmake's build folder;
  ``build/bin/llama-server``: the binary; ``build.log``: everything cmake printed; ``build.json``: the
  options of the finished build (a later call with the same options reuses it); ``build.lock``: held while
  building, so two processes never build at once.

Flags (checked in the vendored ``common/arg.cpp``): ``--spec-type`` takes a comma-separated list of
``none``, ``draft-simple``, ``draft-eagle3``, ``draft-mtp``, ``draft-dflash``, ``draft-dspark``, ``ngram-simple``,
``ngram-map-k``, ``ngram-map-k4v``, ``ngram-mod``, ``ngram-cache`` (``common/speculative.cpp``,
``common_speculative_type_from_name_map``); ``--spec-ngram-simple-size-n`` / ``--spec-ngram-simple-size-m`` (the
lookup n-gram and the drafted m-gram, defaults 12 and 48); ``-md`` / ``--spec-draft-model`` (draft GGUF) with
``--spec-draft-n-max`` / ``--spec-draft-n-min`` (``--draft-max`` was removed); ``--metrics`` turns on
``/metrics``, whose counters (``tools/server/server-task.cpp``, ``server_task_result_metrics::to_metrics``)
are ``llamacpp:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
``..._num_accepted_tokens_total`` and ``llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position}``,
read by :mod:`engine.explain.traffic`.

The server listens on 127.0.0.1 only; every request loop here is bounded.
"""

from __future__ import annotations

import atexit
import dataclasses
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

from engine.decoding.models import cache_root, embedded_gguf_path
from engine.errors import SpeedupLabError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LICENCE = "MIT"
SPEC_TYPES = ("ngram-simple", "draft-simple", "none")
DEFAULT_PORT = 8080
HOST = "127.0.0.1"
ENABLE_ENV = "SPEEDUP_LAB_LLAMACPP"
"""Environment variable: "1" lets the app's Your traffic page start a local llama.cpp server."""
SERVER_ENV = "SPEEDUP_LAB_LLAMA_SERVER"
"""Environment variable: path of a ``llama-server`` binary to use instead of building one."""
SDIST_ENV = "SPEEDUP_LAB_LLAMACPP_SDIST"
"""Environment variable: path of an already downloaded ``llama_cpp_python-0.3.36.tar.gz`` (hash checked)."""
MAX_REQUESTS = 64
MAX_REQUEST_TOKENS = 256
REQUEST_TIMEOUT_S = 120.0

CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
)
"""cmake options (the vendored ``CMakeLists.txt``): ``LLAMA_USE_PREBUILT_UI=OFF`` stops the build from fetching
the web UI from Hugging Face (``scripts/ui-assets.cmake``); ``LLAMA_CURL`` is deprecated and ignored in this
version, so it is not passed; ``GGML_NATIVE=ON`` compiles for this CPU (the build lives in this user's cache)."""

NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"""Compiler flags that keep ggml's AMX kernels out of an x86 build. ``-march=native`` on a CPU with AMX (Intel
Xeon since Sapphire Rapids) compiles them in, and on the 2-core Intel Xeon VMs of December 2026 llama-server then
died with SIGSEGV in ``ggml_backend_amx_mul_mat`` during its warm-up on the embedded Q4_1 model (gdb backtrace;
the same crash as ggml-org/llama.cpp#20824, open upstream; dspy's CI dropped the AMX build for it). An explicit
``-mno-…`` wins over ``-march=native``'s implied flags whatever their order (GCC, Clang), so the rest of the native
build (AVX-512, VNNI) stays; AMD CPUs have no AMX, so their build is the same code."""


def cmake_options() -> tuple[str, ...]:
    """``CMAKE_OPTIONS`` plus, on x86, ``NO_AMX_FLAGS`` for C and C++ (part of the build stamp: a build made
    without them is rebuilt)."""
    if platform.machine().lower() in ("x86_64", "amd64", "i686", "i386"):
        return CMAKE_OPTIONS + (f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}")
    return CMAKE_OPTIONS

Progress = Callable[[str], None]


class LlamaCppError(SpeedupLabError):
    """llama.cpp could not be built or started; the message says why and what to do."""


# ---------------------------------------------------------------------------------------------
# Where things are


def install_root() -> Path:
    """``cache_root() / "llama.cpp-<llama-cpp-python version>"``."""
    return cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"


def build_log_path() -> Path:
    return install_root() / "build.log"


def built_binary() -> Path:
    """Where the build puts ``llama-server`` (it may not exist yet)."""
    return install_root() / "build" / "bin" / "llama-server"


def _build_stamp() -> dict:
    return {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "sdist_sha256": SDIST_SHA256,
            "cmake_options": list(cmake_options()), "target": "llama-server"}


def find_llama_server() -> Path | None:
    """The ``llama-server`` to run: ``$SPEEDUP_LAB_LLAMA_SERVER`` if set, else this cache's finished build, else None.

    Raises:
        LlamaCppError: ``$SPEEDUP_LAB_LLAMA_SERVER`` names no executable file.
    """
    env = os.environ.get(SERVER_ENV)
    if env:
        p = Path(env)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise LlamaCppError(f"{SERVER_ENV}={env} is not an executable file.")
        return p
    b = built_binary()
    stamp = install_root() / "build.json"
    try:
        ok = b.is_file() and json.loads(stamp.read_text()) == _build_stamp()
    except (OSError, ValueError):
        ok = False
    return b if ok else None


# ---------------------------------------------------------------------------------------------
# Building


def check_toolchain() -> dict[str, str]:
    """Paths of cmake and a C and C++ compiler (ninja when present).

    Raises:
        LlamaCppError: cmake or a compiler is missing (with the Debian packages to install).
    """
    found = {"cmake": shutil.which("cmake"), "cc": shutil.which(os.environ.get("CC", "cc")),
             "c++": shutil.which(os.environ.get("CXX", "c++"))}
    missing = [k for k, v in found.items() if not v]
    if missing:
        raise LlamaCppError(f"Cannot build llama.cpp: {', '.join(missing)} not found. Install a C/C++ compiler and "
                            f"cmake (Debian: apt-get install build-essential cmake), or point {SERVER_ENV} at a "
                            f"llama-server binary.")
    ninja = shutil.which("ninja")
    if ninja:
        found["ninja"] = ninja
    return found  # type: ignore[return-value]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(progress: Progress = print) -> Path:
    """The source distribution: ``$SPEEDUP_LAB_LLAMACPP_SDIST``, one already in the cache, or ``pip download``
    (PyPI, the only network access), SHA-256 checked against ``SDIST_SHA256``.

    Raises:
        LlamaCppError: pip failed (no network?), or the file's hash differs.
    """
    env = os.environ.get(SDIST_ENV)
    dest = install_root() / "sdist"
    path = Path(env) if env else dest / SDIST_NAME
    if not path.is_file():
        if env:
            raise LlamaCppError(f"{SDIST_ENV}={env} is not a file.")
        dest.mkdir(parents=True, exist_ok=True)
        progress(f"downloading {SDIST_NAME} from PyPI (pip download, ~77 MB) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dest), "--quiet"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not path.is_file():
            raise LlamaCppError(f"pip could not download llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} "
                                f"(is PyPI reachable?): {(r.stderr or r.stdout).strip()[-400:]}")
    digest = _sha256(path)
    if digest != SDIST_SHA256:
        raise LlamaCppError(f"{path} has SHA-256 {digest}, not the expected {SDIST_SHA256} of {SDIST_NAME}; "
                            f"delete it and retry.")
    return path


VENDOR_DIR = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp"


def extract_sources(sdist: Path, progress: Progress = print) -> Path:
    """Extract the sdist's ``vendor/llama.cpp`` (only that) under ``install_root()/src`` once, keeping the archive's
    paths and file times (so a rebuild after a re-extraction recompiles nothing); return the llama.cpp folder."""
    root = install_root() / "src"
    src = root / VENDOR_DIR
    marker = root / ".complete"
    if marker.is_file() and (src / "CMakeLists.txt").is_file():
        return src
    progress(f"extracting llama.cpp sources into {root} ...")
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r:gz") as tf:
        members = [m for m in tf.getmembers() if m.name == VENDOR_DIR or m.name.startswith(VENDOR_DIR + "/")]
        tf.extractall(root, members=members, filter="data")
    if not (src / "CMakeLists.txt").is_file():
        raise LlamaCppError(f"{sdist} has no {VENDOR_DIR}/CMakeLists.txt: not the expected source distribution.")
    marker.touch()
    return src


_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_STEP = re.compile(r"^\[\s*(\d+)%\]")


def _run_logged(cmd: Sequence[str], log, progress: Progress, label: str) -> int:
    """Run ``cmd``, writing every line to ``log`` and a progress line at every 10 % step it reports."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    last = -1
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            log.write(line)
            m = _NINJA_STEP.match(line)
            frac = int(m.group(1)) / int(m.group(2)) if m else None
            if frac is None:
                mm = _MAKE_STEP.match(line)
                frac = int(mm.group(1)) / 100 if mm else None
            if frac is not None and int(frac * 10) > last:
                last = int(frac * 10)
                progress(f"{label}: {frac:4.0%}" + (f" ({m.group(1)}/{m.group(2)} steps)" if m else ""))
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    return proc.wait()


def build_llama_server(progress: Progress = print, jobs: int | None = None) -> Path:
    """Build ``llama-server`` once into :func:`install_root` and return its path (reused when already built).

    Takes an exclusive lock on ``build.lock`` first: a second process waits, then finds the finished build.

    Raises:
        LlamaCppError: no compiler or cmake; the sdist cannot be fetched; cmake failed (the message names the
            build log).
    """
    existing = find_llama_server()
    if existing is not None:
        return existing
    root = install_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress("another process is building llama-server; waiting for it ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        existing = find_llama_server()
        if existing is not None:
            return existing
        tools = check_toolchain()
        src = extract_sources(fetch_sdist(progress), progress)
        build = root / "build"
        log_path = build_log_path()
        n = jobs or os.cpu_count() or 1
        gen = ["-G", "Ninja"] if "ninja" in tools else []
        t0 = time.monotonic()
        progress(f"building llama-server (cmake, Release, CPU only, {n} jobs; several minutes on 2 cores); "
                 f"log: {log_path}")
        with open(log_path, "w", encoding="utf-8") as log:
            rc = _run_logged([tools["cmake"], "-S", str(src), "-B", str(build), *gen, *cmake_options()], log,
                             progress, "configure")
            if rc == 0:
                rc = _run_logged([tools["cmake"], "--build", str(build), "--target", "llama-server", "-j", str(n)],
                                 log, progress, "compile")
        if rc != 0 or not built_binary().is_file():
            raise LlamaCppError(f"Building llama-server failed (exit {rc}); see the build log: {log_path}")
        (root / "build.json").write_text(json.dumps(_build_stamp(), indent=1))
        progress(f"built {built_binary()} in {time.monotonic() - t0:.0f} s")
        return built_binary()


# ---------------------------------------------------------------------------------------------
# Running


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How to run llama-server.

    Attributes:
        port: TCP port on 127.0.0.1 (1024–65535).
        spec_type: one of ``SPEC_TYPES``.
        threads: CPU threads (-t), ≥ 1.
        draft_model: GGUF of a draft model with the target's vocabulary (needed by draft-simple).
        ngram_n, ngram_m: ngram-simple's lookup n-gram and drafted m-gram (``--spec-ngram-simple-size-n/-m``).
        draft_max: ``--spec-draft-n-max`` for draft-simple.
        ctx_size: context length (``-c``) of the single slot (``-np 1``).
    """

    port: int = DEFAULT_PORT
    spec_type: str = "ngram-simple"
    threads: int = 2
    draft_model: str | None = None
    ngram_n: int = 3
    ngram_m: int = 8
    draft_max: int = 4
    ctx_size: int = 4096

    def validate(self) -> None:
        """Raises LlamaCppError for an unknown spec type, a bad port or thread count, or a missing draft GGUF."""
        if self.spec_type not in SPEC_TYPES:
            raise LlamaCppError(f"Unknown speculation type {self.spec_type!r}: choose one of {', '.join(SPEC_TYPES)}.")
        if isinstance(self.port, bool) or not 1024 <= int(self.port) <= 65535:
            raise LlamaCppError(f"The port must be 1024–65535, got {self.port!r}.")
        if int(self.threads) < 1:
            raise LlamaCppError(f"Threads must be ≥ 1, got {self.threads!r}.")
        if not (1 <= self.ngram_n <= 1024 and 1 <= self.ngram_m <= 1024 and 1 <= self.draft_max <= 64):
            raise LlamaCppError("ngram n and m must be 1–1024 and the draft length 1–64.")
        if self.spec_type == "draft-simple":
            if not self.draft_model:
                raise LlamaCppError(
                    "draft-simple needs a draft model as a GGUF file (--draft-model PATH.gguf) with the target's "
                    "vocabulary. None ships with this app: the embedded package has only the target, and this "
                    "repo's trained draft (assets/smollm2-draft) is in transformers' format, not GGUF. Use "
                    "--spec-type ngram-simple, or pass a GGUF draft.")
            if not Path(self.draft_model).is_file():
                raise LlamaCppError(f"The draft model {self.draft_model} is not a file.")


def server_command(binary: str | Path, model: str | Path, cfg: ServerConfig) -> list[str]:
    """The llama-server command line for ``cfg`` (flag names from the vendored ``common/arg.cpp``)."""
    cfg.validate()
    cmd = [str(binary), "-m", str(model), "--host", HOST, "--port", str(int(cfg.port)), "--metrics",
           "-t", str(int(cfg.threads)), "-c", str(int(cfg.ctx_size)), "-np", "1"]
    if cfg.spec_type == "ngram-simple":
        cmd += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(cfg.ngram_n),
                "--spec-ngram-simple-size-m", str(cfg.ngram_m)]
    elif cfg.spec_type == "draft-simple":
        cmd += ["--spec-type", "draft-simple", "-md", str(cfg.draft_model), "--spec-draft-n-max", str(cfg.draft_max)]
    return cmd


def port_in_use(port: int, host: str = HOST) -> bool:
    """Whether something already listens on host:port (a bind to it fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, int(port)))
        except OSError:
            return True
    return False


def free_port() -> int:
    """A port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only (HOST)
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""


class LlamaServer:
    """A running llama-server child process on 127.0.0.1 (use :func:`start_server`).

    Attributes: cfg, process (subprocess.Popen), log_path, url (``http://127.0.0.1:PORT``), metrics_url.
    """

    def __init__(self, cfg: ServerConfig, process: subprocess.Popen, log_path: Path):
        self.cfg, self.process, self.log_path = cfg, process, log_path
        self.url = f"http://{HOST}:{cfg.port}"
        self.metrics_url = self.url + "/metrics"

    def running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Poll ``/health`` until it answers 200 (the model is loaded).

        Raises:
            LlamaCppError: the process exited, or it was not ready within timeout_s (then it is stopped).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running():
                raise LlamaCppError(f"llama-server exited with code {self.process.returncode} while starting; "
                                    f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if _get(self.url + "/health", timeout=2.0)[0] == 200:
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.25)
        self.stop()
        raise LlamaCppError(f"llama-server was not ready after {timeout_s:.0f} s; log {self.log_path}")

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """Terminate the child (SIGTERM, then SIGKILL after timeout_s); return its exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(cfg: ServerConfig, binary: str | Path | None = None, model: str | Path | None = None,
                 progress: Progress = print, ready_timeout_s: float = 120.0) -> LlamaServer:
    """Start llama-server on the embedded GGUF (building it first if needed) and wait until it is ready.

    Raises:
        LlamaCppError: bad config, port in use, build failure, or the server did not come up.
        ModelLoadError: the embedded model package is missing.
    """
    cfg.validate()
    if port_in_use(cfg.port):
        raise LlamaCppError(f"Port {cfg.port} on {HOST} is in use: choose another with --port.")
    binary = Path(binary) if binary else build_llama_server(progress)
    model = Path(model) if model else embedded_gguf_path()
    cmd = server_command(binary, model, cfg)
    log_path = install_root() / f"server-{cfg.port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    srv = LlamaServer(cfg, proc, log_path)
    try:
        srv.wait_ready(ready_timeout_s)
    except BaseException:
        srv.stop()
        raise
    return srv


# ---------------------------------------------------------------------------------------------
# The app's switch, and servers started for it

LIVE_FLAG = "--llamacpp"
"""Command-line flag of the app (``streamlit run app/main.py -- --llamacpp``) that, like ``SPEEDUP_LAB_LLAMACPP=1``,
lets the Your traffic page start a local llama.cpp server."""
_STARTED: list[LlamaServer] = []


def live_enabled(argv: Sequence[str] | None = None, env: dict | None = None) -> bool:
    """Whether whoever runs the app allowed it to start a llama.cpp server: ``SPEEDUP_LAB_LLAMACPP=1`` in the
    environment, or ``--llamacpp`` among the app's arguments. Off by default, since the app may be served to a
    room of readers and a server costs CPU and memory."""
    e = os.environ if env is None else env
    args = sys.argv[1:] if argv is None else argv
    return e.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes") or LIVE_FLAG in args


def start_for_app(cfg: ServerConfig, progress: Progress = print) -> LlamaServer:
    """:func:`start_server`, remembered so :func:`stop_all` (registered with atexit) stops it when the app exits."""
    srv = start_server(cfg, progress=progress)
    _STARTED.append(srv)
    return srv


def stop_all() -> None:
    """Stop every server :func:`start_for_app` started (also run at interpreter exit)."""
    while _STARTED:
        _STARTED.pop().stop()


atexit.register(stop_all)


# ---------------------------------------------------------------------------------------------
# Traffic


DEFAULT_PROMPTS = (
    "Rewrite this function so it returns the squares of the even numbers only:\n"
    "def f(xs):\n    out = []\n    for x in xs:\n        out.append(x * x)\n    return out\n",
    "Why is the sky blue? Answer in two sentences.",
    "List the days of the week, one per line.",
)


def _loopback_url(url: str) -> str:
    import urllib.parse

    u = urllib.parse.urlparse(url)
    if u.scheme != "http" or u.hostname not in ("127.0.0.1", "localhost", "::1") or u.port is None:
        raise LlamaCppError(f"Requests go to a loopback server only (http://127.0.0.1:PORT), not {url!r}.")
    return f"http://{u.hostname}:{u.port}"


def send_requests(url: str, n: int, prompts: Sequence[str] = DEFAULT_PROMPTS, max_tokens: int = 64,
                  progress: Callable[[int, int], None] | None = None,
                  should_stop: Callable[[], bool] | None = None) -> list[dict]:
    """Send ``n`` greedy ``/completion`` requests (prompts in turn) to a llama-server on loopback, one at a time.

    Args:
        url: ``http://127.0.0.1:PORT`` (loopback only). n: 1..MAX_REQUESTS. max_tokens: 1..MAX_REQUEST_TOKENS.
        progress: called with (done, n) after each request. should_stop: checked before each request.

    Returns:
        [≤ n] per request: ``tokens`` (generated), ``seconds`` (wall time), ``draft_n`` and
        ``draft_n_accepted`` from the response's ``timings`` (0 when absent: the server writes them only for a
        request that drafted).

    Raises:
        LlamaCppError: not loopback, n or max_tokens out of range, or a request failed.
    """
    base = _loopback_url(url)
    if isinstance(n, bool) or not 1 <= int(n) <= MAX_REQUESTS:
        raise LlamaCppError(f"Send 1–{MAX_REQUESTS} requests, not {n!r}.")
    if not 1 <= int(max_tokens) <= MAX_REQUEST_TOKENS:
        raise LlamaCppError(f"Tokens per request must be 1–{MAX_REQUEST_TOKENS}, not {max_tokens!r}.")
    if not prompts:
        raise LlamaCppError("No prompts to send.")
    out = []
    for i in range(int(n)):
        if should_stop is not None and should_stop():
            break
        body = json.dumps({"prompt": prompts[i % len(prompts)], "n_predict": int(max_tokens), "temperature": 0.0,
                           "top_k": 1, "cache_prompt": False, "seed": 0}).encode()
        req = urllib.request.Request(base + "/completion", data=body, headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:  # noqa: S310 - loopback checked
                data = json.loads(r.read().decode("utf-8"))
        except (OSError, urllib.error.URLError, ValueError) as e:
            raise LlamaCppError(f"Request {i + 1} to {base}/completion failed: {e}") from None
        timings = data.get("timings") or {}
        out.append({"tokens": int(data.get("tokens_predicted", timings.get("predicted_n", 0)) or 0),
                    "seconds": time.perf_counter() - t0, "text": data.get("content", ""),
                    # tools/server/server-common.cpp writes them only when the request drafted something
                    "draft_n": int(timings.get("draft_n", 0)), "draft_n_accepted": int(timings.get("draft_n_accepted", 0))})
        if progress is not None:
            progress(i + 1, int(n))
    return out


def scrape(url: str) -> str:
    """The ``/metrics`` text of a loopback llama-server (``url`` = its base address)."""
    status, text = _get(_loopback_url(url) + "/metrics")
    if status != 200:
        raise LlamaCppError(f"{url}/metrics answered HTTP {status}: was the server started with --metrics?")
    return text


# ---------------------------------------------------------------------------------------------
# Command line


def add_serve(sub) -> None:
    p = sub.add_parser("serve-llamacpp", help="build (once) and run llama.cpp's llama-server on the embedded model",
                       description=f"Run llama.cpp's llama-server on the embedded GGUF, bound to {HOST}, with "
                                   f"/metrics and speculative decoding. The first run builds it (several minutes) "
                                   f"from the MIT sources in the PyPI sdist of llama-cpp-python=="
                                   f"{LLAMA_CPP_PYTHON_VERSION} into {install_root()}. Ctrl-C stops it.")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port on {HOST} (default {DEFAULT_PORT})")
    p.add_argument("--spec-type", default="ngram-simple",
                   help="ngram-simple (prompt lookup, default), draft-simple (needs --draft-model) or none")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="CPU threads (default 2)")
    p.add_argument("--draft-model", default=None, help="draft GGUF for --spec-type draft-simple")
    p.add_argument("--ngram-n", type=int, default=3, help="ngram-simple lookup length (default 3)")
    p.add_argument("--ngram-m", type=int, default=8, help="ngram-simple draft length (default 8)")
    p.add_argument("--draft-max", type=int, default=4, help="draft-simple tokens per draft (default 4)")
    p.add_argument("--build-only", action="store_true", help="build (or find) llama-server, print its path, exit")
    p.set_defaults(func=run_serve)


def run_serve(args) -> int:
    def progress(msg: str) -> None:
        print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)

    if args.build_only:
        print(build_llama_server(progress))
        return 0
    cfg = ServerConfig(port=args.port, spec_type=args.spec_type, threads=args.threads, draft_model=args.draft_model,
                       ngram_n=args.ngram_n, ngram_m=args.ngram_m, draft_max=args.draft_max)
    cfg.validate()
    srv = start_server(cfg, progress=progress)
    print(f"llama-server ({cfg.spec_type}) serving {srv.url}  (metrics: {srv.metrics_url}; log: {srv.log_path}); "
          f"Ctrl-C stops it", flush=True)
    try:
        rc = srv.process.wait()
        print(f"llama-server exited with code {rc}; log {srv.log_path}", file=sys.stderr)
        return 1 if rc else 0
    except KeyboardInterrupt:
        print("stopping llama-server ...", file=sys.stderr)
        srv.stop()
        return 0
