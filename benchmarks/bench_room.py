"""A room of readers on one server: K readers open the Live page and all press "Run to the end" at once (the room's
load test); the readers are headless Chromium pages on this machine, or with ``--client protocol`` browserless
Streamlit sessions over the websocket.

Starts ``streamlit run app/main.py`` headless on 127.0.0.1, opens K browser sessions on /live with the default
draft (the trained EAGLE-style head), the chat preset, temperatures alternating 0 and 0.8 (reader i seeded i) and
``--max-new`` tokens, waits until every page is loaded and prefilled, then clicks "Run to the end" on every page
(one driver, as fast as it can) and polls until each says Finished. Measured:

- ``aggregate_tokens_per_s``: all readers' tokens ÷ (last reader done − first click), the median of ``--reps`` room
  runs (default 3);
- ``alone_tokens_per_s``: the same for one reader alone on the same server (reader 0's settings), run before the first
  room and after each (A B A B A B A), the median of those runs; ``ratio`` = aggregate ÷ alone. Why medians of several:
  a lone reader's run of 32 tokens lasts ~0.2 s, and on this VM two of them minutes apart measured 100 and 160 tok/s;
- each reader's wall time (click → "Finished" on its page), the slowest one;
- exceptions or errors on any page; each reader's text against the same settings decoded alone by the engine
  (``tests/e2e/room.py``: whitespace-free comparison of the token texts);
- the server's peak RSS (VmHWM of the Streamlit process), the load average, the CPU model;
- where the two cores went during the run (``CpuSampler``): CPU seconds of the server and of all Chromium processes,
  second by second, from the first click to the last reader's Finished;
- the same K readers in this process without a browser (``engine_room``): pass time, the target's forward, and
  the time spent stacking the readers' caches into one batch cache and back (the most a shared cache could save);
  and one reader alone there before and after it, for the engine's own ratio (no pages, no clicks).

``--client protocol`` replaces the browser with Streamlit-protocol sessions over the app's websocket
(``benchmarks/room_client.py``): the server does everything it does for a Chromium page, but no page renders on
the server's two cores, as in a workshop where every reader's browser runs on their own laptop. The alone runs use
the same client, so the ratio compares like with like.

Usage (an idle machine; ``flock -x /tmp/speedup-cpu.lock`` keeps the team's test runs off the cores meanwhile):
``flock -x /tmp/speedup-cpu.lock .venv/bin/python benchmarks/bench_room.py --readers 16 30``
writes benchmarks/results/room.json and room.md (``--out NAME`` for others: the shipped results name the client and
the machine, ``room_chromium_amd-epyc``, ``room_protocol_xeon``);
``... bench_room.py --client protocol --readers 16 30 --out room_protocol_16_30_xeon`` the browserless room.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.conftest import CHROMIUM, CHROMIUM_ARGS, _free_port  # noqa: E402
from tests.e2e.room import alone_texts, normalized, open_readers, readers_for, run_all  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _start_server(env_extra: dict) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, **env_extra}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(ROOT / "app" / "main.py"), "--server.headless", "true",
         "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false",
         "--server.fileWatcherType", "none"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(180):
        try:
            if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("Streamlit did not start")


class CpuSampler:
    """CPU seconds of the Streamlit server and of every Chromium process, read from ``/proc/<pid>/stat`` every
    ``every_s`` while a room runs (Linux; elsewhere it records nothing). Where the two cores went during a run:
    the server's worker and pages, or the readers' browsers on the same machine. Between two samples only the
    processes seen in both count (a renderer that starts or exits in between adds nothing for that interval)."""

    def __init__(self, server_pid: int, every_s: float = 0.25):
        import threading

        self.server_pid, self.every_s, self.driver_pid = server_pid, every_s, os.getpid()
        self.samples: list[tuple[float, dict]] = []  # (perf_counter s, {pid: (kind, CPU s)})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @staticmethod
    def _machine(stat: str | None = None) -> tuple[int, int] | None:
        """(all CPU time, stolen time) of the machine in clock ticks, from /proc/stat's first line (or ``stat``, that
        file's text): user, nice, system, idle, iowait, irq, softirq and steal summed, and steal, the time the host
        gave this virtual machine's CPUs to someone else (proc(5)). None where it cannot be read."""
        try:
            text = Path("/proc/stat").read_text() if stat is None else stat
            fields = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields[:8]), fields[7] if len(fields) > 7 else 0

    def _read(self) -> dict:
        out = {"_machine": self._machine()}
        for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
            if not pid.isdigit():
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            kind = ("server" if int(pid) == self.server_pid else "driver" if int(pid) == self.driver_pid
                    else "chromium" if "chrom" in comm.lower() else None)
            if kind:
                out[pid] = (kind, (int(rest[11]) + int(rest[12])) / self._hz)  # utime + stime
        return out

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self._read()))
            self._stop.wait(self.every_s)

    def start(self) -> "CpuSampler":
        self._thread.start()
        return self

    @staticmethod
    def _used(a: dict, b: dict) -> dict[str, float]:
        used = {"chromium": 0.0, "server": 0.0, "driver": 0.0}
        for pid, entry in b.items():
            if pid == "_machine" or entry is None:
                continue
            kind, cpu_s = entry
            if pid in a:
                used[kind] += max(cpu_s - a[pid][1], 0.0)
        return used

    def stop(self, until: float | None = None) -> dict:
        """{"window_s", "chromium_cpu_s", "server_cpu_s", "driver_cpu_s" (this process: the Playwright driver's
        Python side, or the protocol readers), "per_second": [[s, Chromium, server], ...]} from the start
        to ``until`` (a ``time.perf_counter()``: the last reader's Finished; default now), the CPU seconds used in
        each whole second of the run; "steal_share": the share of the machine's CPU time the host took away (its
        virtual CPUs' "steal" in /proc/stat) over the window, None where it cannot be read."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.samples.append((time.perf_counter(), self._read()))
        if until is not None:
            after = [x for x in self.samples if x[0] >= until]
            self.samples = [x for x in self.samples if x[0] < until] + after[:1]
        if len(self.samples) < 2:
            return {}
        total = {"chromium": 0.0, "server": 0.0, "driver": 0.0}
        t0 = self.samples[0][0]
        per_second: dict[int, dict[str, float]] = {}
        for (ta, a), (tb, b) in zip(self.samples, self.samples[1:]):
            used = self._used(a, b)
            sec = per_second.setdefault(int(tb - t0), {"chromium": 0.0, "server": 0.0, "driver": 0.0})
            for k, v in used.items():
                total[k] += v
                sec[k] += v
        m0, m1 = self.samples[0][1].get("_machine"), self.samples[-1][1].get("_machine")
        steal = (m1[1] - m0[1]) / (m1[0] - m0[0]) if m0 and m1 and m1[0] > m0[0] else None
        return {"window_s": round(self.samples[-1][0] - t0, 2), "chromium_cpu_s": round(total["chromium"], 2),
                "steal_share": None if steal is None else round(steal, 3),
                "server_cpu_s": round(total["server"], 2), "driver_cpu_s": round(total["driver"], 2),
                "per_second": [[k, round(v["chromium"], 2), round(v["server"], 2)] for k, v in sorted(per_second.items())]}


def _room_run(browser, url: str, readers, timeout_s: float, after_open=None, server_pid: int | None = None) -> dict:
    """One room: the readers' pages opened (``browser`` a Playwright browser, or None for protocol readers,
    ``benchmarks/room_client.py``), every Run pressed at once, each page's Finished awaited."""
    sampler, clients = None, []
    try:
        if browser is None:
            from benchmarks.room_client import open_protocol_readers

            clients = open_protocol_readers(url, readers)
        else:
            open_readers(browser, url, readers)
        if after_open is not None:  # the pages are loaded and prefilled: the run starts now
            after_open()
        if server_pid is not None:
            sampler = CpuSampler(server_pid).start()
        if browser is None:
            from benchmarks.room_client import run_all_protocol

            t_first = run_all_protocol(clients, timeout_s=timeout_s)
        else:
            t_first = run_all(readers, timeout_s=timeout_s)
        done = [r for r in readers if r.t_done is not None and r.error is None]
        t_last = max((r.t_done for r in done), default=time.perf_counter())
        cpu = sampler.stop(until=t_last) if sampler is not None else {}
        tokens = sum(r.tokens for r in done)
        return {"readers": len(readers), "tokens": tokens, "elapsed_s": t_last - t_first,
                "tokens_per_s": tokens / (t_last - t_first) if t_last > t_first else None,
                "wall_s": [r.wall_s for r in readers], "errors": [r.error for r in readers if r.error], "cpu": cpu,
                "messages_per_reader": [c.messages for c in clients] or None}
    finally:
        for c in clients:
            c.close()
        for r in readers:
            if r.page is not None:
                r.page.context.close()


def _in_thread(fn):
    """``fn()`` in a thread of its own that ends before this returns (its result, or its exception raised here).

    Why: with PyTorch's OpenMP (libgomp), once a thread that stays alive (this process's main thread) has run a
    parallel op, every other thread's parallel ops ran ~1.6× slower here (Intel Xeon, 2 cores: one
    target pass in the room's worker 41 instead of 25 ms), so the engine room below measured a slower engine than
    the server's. A thread that has ended leaves no such trace, so all torch work of this process outside the room's
    own worker runs in threads like this one."""
    import threading

    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller
            box["err"] = e

    th = threading.Thread(target=run)
    th.start()
    th.join()
    if "err" in box:
        raise box["err"]
    return box.get("out")


def engine_room(k: int, max_new: int, no_draft_above: str = "") -> dict:
    """The same room in this process, without Streamlit: K decoders (the page's settings) prefilled, then submitted
    together to a ``Room`` (the clock runs from then to the last reader's end, as the page's runs start after their
    prefills); per pass the time of the whole pass, of the target's forward, and of stacking the rows' caches and
    giving them back (what a shared batch cache would save at most). ``no_draft_above``: the server's drafting limit,
    the same here."""
    import threading

    from engine.decoding.models import EMBEDDED, EMBEDDED_HEAD, load_model
    from engine.decoding.drafts import make_proposer
    from engine.decoding.sampling import SamplingConfig
    from engine.decoding.scheduler import Room
    from engine.decoding.speculative import SpeculativeDecoder, encode_prompt
    from engine.explain.presets import preset_text

    target = _in_thread(lambda: load_model(EMBEDDED))
    ids = encode_prompt(target.tokenizer, preset_text("chat"))
    room = Room(target, no_draft_above=no_draft_above or "auto", warm_up=True)  # warmed up as the server's room
    try:
        decs = _in_thread(lambda: [
            SpeculativeDecoder(target, make_proposer(EMBEDDED_HEAD, target), ids,
                               gamma=_head_gamma(),
                               sampling=SamplingConfig(temperature=0.0 if i % 2 == 0 else 0.8), seed=i,
                               max_new_tokens=max_new) for i in range(k)])
        # the prefills first, as the pages are prefilled before their Run is pressed; the clock starts after them
        ths = [threading.Thread(target=lambda d=d: room.prefill(d)) for d in decs]
        for th in ths:
            th.start()
        for th in ths:
            th.join(timeout=900)
        sampler = CpuSampler(os.getpid()).start()  # this process's cores, and what the host took away meanwhile
        t0 = time.perf_counter()
        ths = [threading.Thread(target=lambda d=d: room.run(d)) for d in decs]
        for th in ths:
            th.start()
        for th in ths:
            th.join(timeout=900)
        elapsed = time.perf_counter() - t0
        cpu = sampler.stop()
        full = [p for p in room.passes if p.rows == k and p.fed_rows == k]
        med = (lambda xs: statistics.median(xs) if xs else None)
        return {"readers": k, "elapsed_s": elapsed, "tokens_per_s": sum(len(d.new_ids) for d in decs) / elapsed,
                "passes": len(room.passes), "full_passes": len(full),
                "pass_ms": med([p.ms for p in full]), "target_ms": med([p.target_ms for p in full]),
                "stack_ms": med([p.stack_ms + p.unstack_ms for p in full]),
                "stack_share": (sum(p.stack_ms + p.unstack_ms for p in full) / sum(p.ms for p in full)) if full else None,
                "cores_used": cpu["server_cpu_s"] / cpu["window_s"] if cpu.get("window_s") else None,
                "steal_share": cpu.get("steal_share")}
    finally:
        room.close()


def _head_gamma() -> int:
    """The head's γ the Live page picks: with its default adaptive length, the cap (``ADAPTIVE_GAMMA_MAX``; each round
    drafts 0 to γ, ``engine.decoding.draft_length``)."""
    from engine.decoding.draft_length import ADAPTIVE_GAMMA_MAX

    return ADAPTIVE_GAMMA_MAX


def _share(x) -> str:
    """A share as a whole percentage, or — when unknown."""
    return "—" if x is None else f"{x:.0%}"


def _passes(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readers", type=int, nargs="+", default=[16], help="room sizes K to run (default 16)")
    ap.add_argument("--max-new", type=int, default=32, help="new tokens each reader asks for (default 32)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a room may take at most")
    ap.add_argument("--reps", type=int, default=3,
                    help="room runs per size, each followed by a run of one reader alone (one more before the first): "
                         "the ratio is the median room over the median alone (default 3)")
    ap.add_argument("--no-draft-above", default="",
                    help="SPEEDUP_LAB_NO_DRAFT_ABOVE for the server (default auto: the room drafts where its measured "
                         "passes say it pays; off: always draft)")
    ap.add_argument("--sampling-rule", choices=("standard", "gumbel"), default="standard",
                    help="the sampled readers' rule: standard (default) or the drafter-invariant gumbel, which keeps "
                         "a sampled reader's text equal to alone whether the room's passes draft or not")
    ap.add_argument("--client", choices=("chromium", "protocol"), default="chromium",
                    help="the readers: headless Chromium pages on this machine (default), or "
                         "Streamlit-protocol sessions over the websocket without a browser (benchmarks/room_client.py: "
                         "a room whose browsers run on the readers' own machines)")
    ap.add_argument("--out", default=None,
                    help="results name: benchmarks/results/<out>.json and .md (default room, or room_protocol with "
                         "--client protocol; an existing file of that name, such as the committed results, is replaced)")
    args = ap.parse_args()
    if min(args.readers) < 1 or args.max_new < 1 or args.timeout <= 0 or args.reps < 1:
        ap.error("--readers, --max-new and --reps must be whole numbers ≥ 1 and --timeout above 0")
    if args.out is None:
        args.out = "room" if args.client == "chromium" else "room_protocol"
    import contextlib

    from playwright.sync_api import sync_playwright

    pass_log = RESULTS / f".{args.out}_passes.jsonl"
    RESULTS.mkdir(parents=True, exist_ok=True)
    pass_log.unlink(missing_ok=True)
    env = {"SPEEDUP_LAB_NO_DRAFT_ABOVE": args.no_draft_above, "SPEEDUP_LAB_ROOM_LOG": str(pass_log)}
    proc, url = _start_server(env)
    rows = []
    t0 = time.time()
    try:
        with (sync_playwright() if args.client == "chromium" else contextlib.nullcontext()) as pw:
            browser = (pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
                       if pw is not None else None)
            # warm-up: the first load of the embedded model and the first passes are slow
            _room_run(browser, url, readers_for(1, 4), args.timeout)
            for k in args.readers:
                # one reader alone, then (the room, one reader alone) reps times: A (B A)…; medians of each kind
                alones = [_room_run(browser, url, readers_for(1, args.max_new), args.timeout, server_pid=proc.pid)]
                rooms = []
                for _ in range(args.reps):
                    readers = readers_for(k, args.max_new, rule=args.sampling_rule)
                    n_before = []  # the pass log's length once every page is prefilled (the prefills are not the run)
                    room = _room_run(browser, url, readers, args.timeout,
                                     after_open=lambda: n_before.append(len(_passes(pass_log))), server_pid=proc.pid)
                    room["server"] = _passes(pass_log)[n_before[0] if n_before else 0:]
                    room["readers_run"] = readers
                    rooms.append(room)
                    alones.append(_room_run(browser, url, readers_for(1, args.max_new), args.timeout,
                                            server_pid=proc.pid))
                rated = sorted((x for x in rooms if x["tokens_per_s"]), key=lambda x: x["tokens_per_s"])
                room = rated[len(rated) // 2] if rated else rooms[0]  # the median run (its walls, passes, CPU)
                readers, server = room["readers_run"], room["server"]
                want = _in_thread(lambda: alone_texts(readers))
                same_runs = [[r.error is None and normalized(r.text) == normalized(w)
                              for r, w in zip(x["readers_run"], want)] for x in rooms]
                same = same_runs[rooms.index(room)]
                alone_tps = statistics.median([x["tokens_per_s"] for x in alones if x["tokens_per_s"]])
                room_tps = statistics.median([x["tokens_per_s"] for x in rooms if x["tokens_per_s"]])
                walls = [w for w in room["wall_s"] if w is not None]
                rows.append({
                    "readers": k, "max_new_tokens": args.max_new, "reps": args.reps,
                    "aggregate_tokens_per_s": room_tps, "alone_tokens_per_s": alone_tps,
                    "room_runs_tokens_per_s": [x["tokens_per_s"] for x in rooms],
                    "alone_runs_tokens_per_s": [x["tokens_per_s"] for x in alones],
                    "ratio": room_tps / alone_tps if room_tps and alone_tps else None,
                    "texts_identical_runs": [sum(x) for x in same_runs],
                    "alone_wall_s": [x["wall_s"][0] for x in alones],
                    "alone_steal_share": [x["cpu"].get("steal_share") for x in alones],
                    "slowest_wall_s": max(walls) if walls else None,
                    "median_wall_s": statistics.median(walls) if walls else None,
                    "errors": [e for x in rooms for e in x["errors"]], "texts_identical": sum(same),
                    "texts_checked": len(same),
                    "different": [r.index for r, s in zip(readers, same) if not s],
                    # what differed: the page's text and the engine's alone, whitespace removed (as compared)
                    "differences": [{"reader": r.index, "temperature": r.temperature, "seed": r.seed,
                                     "error": r.error, "room": normalized(r.text or ""), "alone": normalized(w)}
                                    for r, w, s in zip(readers, want, same) if not s],
                    "server_peak_rss_mb": _peak_rss_mb(proc.pid), "cpu_during_run": room["cpu"]})
                med = (lambda xs: statistics.median(xs) if xs else None)
                rows[-1]["server_passes"] = {
                    "passes": len(server), "rows_median": med([p["rows"] for p in server]),
                    "rows_max": max((p["rows"] for p in server), default=None),
                    "pass_ms_median": med([p["ms"] for p in server]),
                    "target_ms_median": med([p["target_ms"] for p in server]),
                    "draft_ms_median": med([p.get("draft_ms", 0.0) for p in server]),
                    "judge_ms_median": med([p.get("judge_ms", 0.0) for p in server]),
                    "judge_ms_max": max((p.get("judge_ms", 0.0) for p in server), default=None),
                    "busy_share": sum(p["ms"] for p in server) / 1000 / room["elapsed_s"] if room["elapsed_s"] else None}
                # the engine without Streamlit: one reader alone, the room, one reader alone (the median of the two)
                alone_e = [_in_thread(lambda: engine_room(1, args.max_new, args.no_draft_above))]
                rows[-1]["engine_room"] = _in_thread(lambda: engine_room(k, args.max_new, args.no_draft_above))
                alone_e.append(_in_thread(lambda: engine_room(1, args.max_new, args.no_draft_above)))
                rows[-1]["engine_alone_tokens_per_s"] = [x["tokens_per_s"] for x in alone_e]
                rows[-1]["engine_ratio"] = (rows[-1]["engine_room"]["tokens_per_s"]
                                            / statistics.fmean(rows[-1]["engine_alone_tokens_per_s"]))
                print(json.dumps(rows[-1]), flush=True)
            if browser is not None:
                browser.close()
    finally:
        rss = _peak_rss_mb(proc.pid)
        proc.terminate()
        proc.wait(timeout=30)
    from benchmarks.machine import machine_line, machine_meta
    from engine.decoding.models import EMBEDDED, load_model

    meta = machine_meta(load_model(EMBEDDED))  # the CPU and the compute path the server's target loads with
    result = {"rows": rows, "server_peak_rss_mb": rss, "cpu": meta["cpu"], "cores": os.cpu_count(), "meta": meta,
              "load_avg_after": os.getloadavg(), "elapsed_s": time.time() - t0,
              "no_draft_above": args.no_draft_above or None, "client": args.client,
              "command": " ".join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT))
                                   else sys.executable, "benchmarks/bench_room.py", *sys.argv[1:]]),
              "settings": f"default draft (trained EAGLE-style head, γ {_head_gamma()}), chat preset, temperatures 0 "
                          "and 0.8 alternating (reader i seed i), instant autoplay, one server, "
                          + ("one headless Chromium on the same machine (a browser context per reader)"
                             if args.client == "chromium" else
                             "readers as Streamlit-protocol sessions over the websocket, no browser "
                             "(benchmarks/room_client.py: what the server does for a room whose browsers run elsewhere)")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Room benchmark: K readers press Run to the end at once ({args.max_new} new tokens each)", "",
             f"CPU: {result['cpu']} ({result['cores']} cores). Command: `{result['command']}`. "
             f"{result['settings']}. Drafting limit: {result['no_draft_above'] or 'auto (the room measures where drafting pays)'}.", "", machine_line(meta), "",
             "| readers | aggregate tok/s | one reader alone tok/s | ratio | slowest reader s | median s | "
             "alone s | errors | texts = alone | server peak RSS MB | stolen by the host: room (alone runs) |",
             "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['readers']} | {r['aggregate_tokens_per_s']:.1f} | {r['alone_tokens_per_s']:.1f} | "
                     f"{r['ratio']:.2f}× | {r['slowest_wall_s']:.1f} | {r['median_wall_s']:.1f} | "
                     + " / ".join(f"{x:.1f}" for x in r["alone_wall_s"] if x is not None)
                     + f" | {len(r['errors'])} | {r['texts_identical']}/{r['texts_checked']} | "
                     f"{r['server_peak_rss_mb']:.0f} | {_share((r.get('cpu_during_run') or {}).get('steal_share'))} ("
                     + ", ".join(_share(x) for x in r.get("alone_steal_share", [])) + ") |")
    for r in rows:
        lines += ["", f"{r['readers']} readers, each run ({r['reps']} rooms, each followed by one reader alone, one alone "
                  "before the first): room tok/s " + ", ".join(f"{x:.1f}" for x in r["room_runs_tokens_per_s"] if x)
                  + "; alone tok/s " + ", ".join(f"{x:.1f}" for x in r["alone_runs_tokens_per_s"] if x)
                  + "; texts equal to alone " + ", ".join(f"{x}/{r['texts_checked']}" for x in r["texts_identical_runs"])
                  + ". The row above: medians; the walls, texts and passes below are the median room run's."]
    lines += ["", "Stolen by the host: the share of the machine's CPU time the hypervisor gave to other machines during "
              "the run (/proc/stat's steal). This VM's cores are shared with others: runs with a large share are slow "
              "for that reason and are not comparable with runs without."]
    for r in rows:  # a text that differed from the same settings alone: where (whitespace removed, as compared)
        for d in r.get("differences", []):
            a, b = d["alone"], d["room"]
            j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            lines += ["", f"{r['readers']} readers, reader {d['reader']} (temperature {d['temperature']}, seed "
                      f"{d['seed']}){': error ' + d['error'] if d['error'] else ''}: the texts part at character {j} "
                      f"of {len(a)}: alone `…{a[max(0, j - 20):j + 20]}…`, in the room `…{b[max(0, j - 20):j + 20]}…`."]
    lines += ["", "The server's room during each run (its pass log): passes, rows per pass (median, max), pass and "
              "target-forward ms (medians), judging (every row's rule and handing its round to its page: median, max), and "
              "the share of the run's time the worker was busy:", "",
              "| readers | passes | rows median | rows max | pass ms | target ms | batched draft ms | judge ms | "
              "worker busy |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = r["server_passes"]
        f = (lambda x, spec=".1f": "—" if x is None else format(x, spec))
        lines.append(f"| {r['readers']} | {sp['passes']} | {f(sp['rows_median'])} | {sp['rows_max']} | "
                     f"{f(sp['pass_ms_median'])} | {f(sp['target_ms_median'])} | {f(sp.get('draft_ms_median'))} | "
                     f"{f(sp.get('judge_ms_median'))}, {f(sp.get('judge_ms_max'))} | {f(sp['busy_share'], '.0%')} |")
    lines += ["", "The same room in this benchmark's process, the engine without Streamlit (`engine_room`: K decoders "
              "prefilled, then submitted together; the clock starts after the prefills; medians over the passes that "
              "served every reader):", "",
              "| readers | tok/s | pass ms | target forward ms | stacking + unstacking ms | stacking share | cores used | "
              "stolen by the host |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r["engine_room"]
        f = (lambda x, spec=".1f": "—" if x is None else format(x, spec))
        lines.append(f"| {e['readers']} | {f(e['tokens_per_s'])} | {f(e['pass_ms'])} | {f(e['target_ms'])} | "
                     f"{f(e['stack_ms'])} | {f(e['stack_share'], '.1%')} | {f(e.get('cores_used'), '.2f')} | "
                     f"{f(e.get('steal_share'), '.0%')} |")
    for r in rows:
        if r.get("engine_ratio"):
            lines += ["", f"{r['readers']} readers in this process: {r['engine_ratio']:.2f}× one reader alone in this "
                      "process (" + " and ".join(f"{x:.1f}" for x in r["engine_alone_tokens_per_s"])
                      + " tok/s, before and after the room): the engine's own ratio, without pages or clicks."]
    lines += ["", "Where the two cores went from the first click to the last reader's Finished (`CpuSampler`: CPU seconds "
              "from /proc every 0.25 s, an interval counted in the second it ends in; the JSON has them second by second):", "",
              *(["| readers | window s | Chromium CPU s | server CPU s | this process CPU s (the Playwright driver) "
                 "| stolen by the host | Chromium, server per second of the run |", "|---|---|---|---|---|---|---|"]
                if args.client == "chromium" else
                ["| readers | window s | server CPU s | this process CPU s (the protocol readers) | stolen by the host "
                 "| server per second of the run |", "|---|---|---|---|---|---|"])]
    for r in rows:
        c = r.get("cpu_during_run") or {}
        if c:
            steal = _share(c.get("steal_share"))
            if args.client == "chromium":
                secs = " ".join(f"{ch:.1f}/{sv:.1f}" for _, ch, sv in c["per_second"])
                lines.append(f"| {r['readers']} | {c['window_s']:.1f} | {c['chromium_cpu_s']:.1f} | "
                             f"{c['server_cpu_s']:.1f} | {c.get('driver_cpu_s', 0.0):.1f} | {steal} | {secs} |")
            else:
                secs = " ".join(f"{sv:.1f}" for _, _, sv in c["per_second"])
                lines.append(f"| {r['readers']} | {c['window_s']:.1f} | {c['server_cpu_s']:.1f} | "
                             f"{c.get('driver_cpu_s', 0.0):.1f} | {steal} | {secs} |")
    lines += ["", f"Load average after the run: {', '.join(f'{x:.1f}' for x in result['load_avg_after'])} "
              + ("(the browser's pages run on the same cores as the server)." if args.client == "chromium" else
                 "(no browser: the readers are websocket sessions in this process).")]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
