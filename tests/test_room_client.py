"""The browserless room reader's Markdown decoding (benchmarks/room_client.text_of_markdown): what the Live page
writes for a generated text (app/live_view.generated_markdown) decodes back to the tokens' characters."""

import pytest

from app.live_view import generated_markdown
from benchmarks.room_client import text_of_markdown
from tests.e2e.room import normalized

TEXTS = [
    [("Hello", "accepted"), (" world", "bonus")],
    [("a]b", "plain"), ("[x](y)", "correction"), ("\\n", "accepted")],
    [(":+1: -> <- -- ~= ==", "accepted"), ("**bold** _it_ `code`", "bonus")],
    [("line one\nline two", "plain"), ("\n\n", "accepted"), ("\tindented  spaces", "correction")],
    [("$x$ & <b>html</b> #1 | a|b", "plain"), ("é ü 你好 🙂", "bonus")],
    [(":green-background[fake]", "accepted")],
]


@pytest.mark.parametrize("pieces", TEXTS)
def test_generated_markdown_decodes_to_its_characters(pieces):
    md = generated_markdown(pieces)
    assert normalized(text_of_markdown(md)) == normalized("".join(t for t, _ in pieces))


def test_hand_example():
    # a colour directive, an escaped bracket and colon with the page's zero-width space, an escaped backslash
    assert text_of_markdown(":green-background[1\\.]:blue-background[ a\\]\\:\u200bb\\\\]") == "1. a]:b\\"


def test_steal_is_read_from_proc_stat():
    from benchmarks.bench_room import CpuSampler

    # user nice system idle iowait irq softirq steal guest guest_nice: 100+0+50+800+10+0+0+40 = 1000 ticks, 40 stolen
    assert CpuSampler._machine("cpu  100 0 50 800 10 0 0 40 7 0\ncpu0 50 0 25 400 5 0 0 20 0 0\n") == (1000, 40)
    assert CpuSampler._machine("not a stat file") is None
