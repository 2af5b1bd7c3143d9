"""A reader without a browser: one Streamlit session driven over the app's websocket, speaking Streamlit's own
protocol (``BackMsg`` out, ``ForwardMsg`` in, the protobufs shipped in the ``streamlit`` package), for
``benchmarks/bench_room.py --client protocol``.

What it stands for: a room whose readers' browsers run on their own laptops. The server does all it does for a
Chromium page (a session, the script and its fragment reruns, every delta, the websocket), but nothing renders
on the server's cores. ``bench_room`` runs headless Chromium on the server's own cores by
default; this client measures the server alone.

What it sends is what Chromium sends (captured from the Live page with Playwright's websocket events):
- on open, a ``rerun_script`` with the page's query string, ``page_name`` "live" and no widget states;
- on "Run to the end", a ``rerun_script`` for the fragment that holds the button (its ``fragment_id`` from the
  deltas), with the button's ``trigger_value``. Chromium also sends every other widget's value; the server keeps
  those from the page's first run, and ``bench_room`` checks every reader's text against the same settings
  decoded alone, which would fail if a setting were lost.

What it reads: the status alert "Finished (…): N tokens in R rounds" (the run's end, as the Chromium driver
reads it), the generated text's Markdown (decoded by ``text_of_markdown``) and any exception element.
"""

from __future__ import annotations

import re
import threading
import time
from urllib.parse import urlparse

from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ClientState_pb2 import ContextInfo
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from websockets.sync.client import connect

from tests.e2e.room import FINISHED, Reader


_DIRECTIVE = re.compile(r":[a-z]+(?:-[a-z]+)*\[")  # a colour directive's opening, ":green-background["


def text_of_markdown(body: str) -> str:
    """The characters a reader sees in the Live page's generated-text Markdown (``app/live_view.text_span``):
    colour directives ``:name[`` and their closing ``]`` dropped, backslash escapes undone (the page escapes every
    ASCII punctuation character), zero-width spaces dropped. Line breaks and spaces stay as they are (the room
    compares whitespace-free texts, ``tests/e2e/room.normalized``)."""
    out, i, n = [], 0, len(body)
    directive = _DIRECTIVE
    while i < n:
        ch = body[i]
        if ch == "\\" and i + 1 < n:
            out.append(body[i + 1])
            i += 2
            continue
        m = directive.match(body, i)
        if m:
            i = m.end()
            continue
        if ch != "]":
            out.append(ch)
        i += 1
    return "".join(out).replace("\u200b", "")


class ProtocolReader:
    """One reader's Streamlit session over a websocket (a thread reads every ``ForwardMsg``).

    ``open()`` runs the page once with the reader's query string and returns when that run has finished;
    ``click_run()`` presses "Run to the end"; ``done`` is set when the page shows Finished (or an exception), with
    ``reader.t_done``, ``reader.tokens``, ``reader.text`` and ``reader.error`` filled in as the Chromium driver
    fills them. Raises ``RuntimeError`` if the page has no Run button after its first run."""

    def __init__(self, base_url: str, reader: Reader, page: str = "live"):
        self.base_url, self.reader, self.page = base_url, reader, page
        self.ws = None
        self.page_hash = ""
        self.query = reader.query
        self.run_id: str | None = None
        self.run_fragment = ""
        self.generated_path: tuple | None = None
        self.text_md = ""
        self.messages = 0
        self.bytes = 0
        self._idle = threading.Event()  # the session's script is not running
        self._starts = 0  # script runs the server has started for this session
        self._clicked = False
        self.done = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the websocket -------------------------------------------------------------------------------------
    def _context(self):
        return ContextInfo(timezone="UTC", timezone_offset=0, locale="en-US", url=f"{self.base_url}/{self.page}",
                           is_embedded=False, color_scheme="light")

    def _send_rerun(self, widgets=(), fragment_id: str = "") -> None:
        msg = BackMsg()
        rr = msg.rerun_script
        rr.query_string = self.query
        if self.page_hash:
            rr.page_script_hash = self.page_hash
        else:
            rr.page_name = self.page
        for wid, trigger in widgets:
            w = rr.widget_states.widgets.add()
            w.id = wid
            w.trigger_value = trigger
        if fragment_id:
            rr.fragment_id = fragment_id
        rr.context_info.CopyFrom(self._context())
        self._idle.clear()
        self.ws.send(msg.SerializeToString())

    def open(self, timeout_s: float = 300.0, settle_s: float = 1.0) -> None:
        host = urlparse(self.base_url).netloc
        self.ws = connect(f"ws://{host}/_stcore/stream", subprotocols=["streamlit"],
                          additional_headers={"Origin": self.base_url}, max_size=None, open_timeout=60)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        self._send_rerun()
        deadline = time.perf_counter() + timeout_s
        while True:  # idle, and still idle a second later (a page that loads the model reruns itself once loaded)
            if not self._idle.wait(max(deadline - time.perf_counter(), 0.0)):
                raise RuntimeError(f"reader {self.reader.index}: the page's first run did not finish in "
                                   f"{timeout_s:.0f} s")
            starts = self._starts
            time.sleep(settle_s)
            if self._idle.is_set() and self._starts == starts:
                break
        if self.run_id is None:
            raise RuntimeError(f"reader {self.reader.index}: no 'Run to the end' button on /{self.page}")

    def click_run(self) -> None:
        self.reader.t_click = time.perf_counter()
        self._clicked = True
        self._send_rerun([(self.run_id, True)], self.run_fragment)

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        try:
            for data in self.ws:
                self.messages += 1
                self.bytes += len(data)
                msg = ForwardMsg()
                msg.ParseFromString(data)
                self._on(msg)
        except Exception as e:  # noqa: BLE001 - a closed socket ends the reader; say so if its run was pending
            if self._clicked and not self.done.is_set():
                self.reader.error = f"websocket closed: {type(e).__name__}"
                self.done.set()
        finally:
            self._idle.set()

    def _on(self, msg) -> None:
        kind = msg.WhichOneof("type")
        if kind == "new_session":
            self.page_hash = msg.new_session.page_script_hash or self.page_hash
        elif kind == "page_info_changed":
            self.query = msg.page_info_changed.query_string
        elif kind == "session_status_changed":
            if msg.session_status_changed.script_is_running:
                self._starts += 1
                self._idle.clear()
            else:
                self._idle.set()
        elif kind == "delta":
            self._on_delta(msg)

    def _on_delta(self, msg) -> None:
        delta, path = msg.delta, tuple(msg.metadata.delta_path)
        if delta.WhichOneof("type") == "add_block":
            if delta.add_block.id.endswith("-lv_generated"):
                self.generated_path = path
            return
        if delta.WhichOneof("type") != "new_element":
            return
        el = delta.new_element
        kind = el.WhichOneof("type")
        if kind == "button" and el.button.id.endswith("-lv_run"):
            self.run_id, self.run_fragment = el.button.id, delta.fragment_id
        elif kind == "markdown" and self.generated_path is not None and path[:-1] == self.generated_path:
            self.text_md = el.markdown.body
        elif self._clicked and not self.done.is_set():
            if kind == "alert":
                m = FINISHED.search(el.alert.body)
                if m:
                    self.reader.t_done = time.perf_counter()
                    self.reader.tokens = int(m.group(2))
                    self.reader.text = text_of_markdown(self.text_md)
                    self.done.set()
                elif el.alert.format == el.alert.ERROR:
                    self.reader.t_done, self.reader.error = time.perf_counter(), f"error on the page: {el.alert.body[:200]}"
                    self.done.set()
            elif kind == "exception":
                self.reader.t_done = time.perf_counter()
                self.reader.error = f"exception on the page: {el.exception.type}: {el.exception.message[:200]}"
                self.done.set()


def open_protocol_readers(base_url: str, readers: list[Reader], timeout_s: float = 300.0) -> list[ProtocolReader]:
    """A websocket session per reader on /live with its settings; returns when every page's first run is over."""
    clients = [ProtocolReader(base_url, r) for r in readers]
    try:
        for c in clients:
            c.open(timeout_s)
    except Exception:
        for c in clients:
            c.close()
        raise
    return clients


def run_all_protocol(clients: list[ProtocolReader], timeout_s: float = 600.0) -> float:
    """Press "Run to the end" for every reader at once and wait until each page says Finished (bounded by
    ``timeout_s``). Returns the time of the first click (``time.perf_counter()``)."""
    t_first = time.perf_counter()
    for c in clients:
        c.click_run()
    deadline = t_first + timeout_s
    for c in clients:
        if not c.done.wait(max(deadline - time.perf_counter(), 0.0)):
            c.reader.error = f"not finished within {timeout_s:.0f} s"
    for c in clients:  # the page's last redraw of the run: the text as it stays on the page
        c._idle.wait(30)
        if c.reader.error is None:
            c.reader.text = text_of_markdown(c.text_md)
    return t_first
