"""engine.decoding.draft_policy: the room drafts where its own measured passes say drafting pays."""

import pytest

from engine.decoding.draft_policy import DraftPolicy, band


def test_bands_are_the_nearest_powers_of_two():
    assert [band(r) for r in (1, 2, 3, 5, 6, 11, 12, 15, 16, 22, 23, 32)] == [1, 2, 4, 4, 8, 8, 16, 16, 16, 16, 32, 32]
    with pytest.raises(ValueError):
        band(0)


def test_a_reader_alone_and_a_few_readers_always_draft():
    """Below ``MEASURED_FROM``'s band (fewer than 6 readers) a pass drafts whatever was measured: as alone, so every text is the text
    alone."""
    pol = DraftPolicy()
    for rows in (1, 2, 3, 5):
        for _ in range(30):
            assert pol.drafts(rows)
            pol.record(rows, True, rows, 100.0)  # drafting that never pays still drafts here
            pol.record(rows, False, rows, 1.0)
        assert pol.rates(rows).drafts


def _pass(pol, rows, drafted, emitted, ms):
    assert pol.drafts(rows) == drafted
    pol.record(rows, drafted, emitted, ms)


def test_many_readers_start_plain_try_drafting_later_then_keep_the_faster_and_try_the_other_again():
    """16 readers: drafted passes 28 tokens in 117 ms, plain passes 16 tokens in 40 ms (the AMD EPYC's room): per reader
    28/16 / 0.117 = 14.96 against 16/16 / 0.040 = 25.0 tokens/s, so plain; drafting measured 0.60×, under the
    clear-loss margin 0.75, so every 4 × 3 = 12th decision of the band tries it again."""
    pol = DraftPolicy(explore_every=3)
    _pass(pol, 15, False, 15, 40.0)  # a band of 16 (15 readers: the same band) starts plain ...
    for _ in range(10):
        _pass(pol, 16, False, 16, 40.0)
    _pass(pol, 16, True, 28, 117.0)  # ... and tries drafting at its 4 × 3 = 12th decision
    pol.record(16, True, 28, 117.0)
    r = pol.rates(16)
    assert r.drafted == pytest.approx((28 / 16) * 2 / 0.234)
    assert r.plain == pytest.approx(6 / 0.240)  # the kept (last 6) plain passes
    assert not r.drafts
    assert "0.60×" in r.line() and "does not draft" in r.line()
    choices = [pol.drafts(16) for _ in range(24)]  # decisions 13..36 of the band: 24 and 36 try drafting again
    assert [i + 13 for i, c in enumerate(choices) if c] == [24, 36]
    assert not pol.drafts(8)  # another band measures on its own: plain first
    assert pol.drafts(1) and pol.drafts(4)


def test_when_drafting_pays_it_keeps_drafting():
    """8 readers: plain 8 tokens in 15 ms (66.7 per reader per s), drafted 16 in 20 ms (100): plain is 0.67 of it, under
    0.75, so plain is tried every 4 × 2 = 8th decision; with plain at 8 tokens in 11 ms (90.9, over 0.75 of 100)
    every 2nd."""
    pol = DraftPolicy(explore_every=2)
    _pass(pol, 8, False, 8, 15.0)  # decision 1: plain first
    for _ in range(6):  # decisions 2..7: plain until drafting's first try at 4 × 2 = 8
        _pass(pol, 8, False, 8, 15.0)
    _pass(pol, 8, True, 16, 20.0)  # decision 8
    assert pol.rates(8).drafts
    assert [pol.drafts(9) for _ in range(8)] == [True] * 7 + [False]  # decisions 9..16: 16 tries plain
    pol2 = DraftPolicy(explore_every=2, measured_from=4)
    pol2.record(4, True, 8, 20.0)
    pol2.record(4, False, 4, 11.0)
    assert [pol2.drafts(4) for _ in range(4)] == [True, False, True, False]  # decisions 1..4: 2 and 4 try plain


def test_a_kind_that_keeps_losing_clearly_is_tried_less_and_less_often():
    """16 readers where drafting keeps losing clearly (28 tokens in 117 ms against 16 in 40): with explore_every 2, the
    first try at decision 4 × 2 = 8, then 16 (every 8th while it loses clearly), and after each further clear loss the
    wait doubles: 24, 40, 72, 136, then at most 16 × 8 = 128 decisions apart: 264, 392."""
    pol = DraftPolicy(explore_every=2)
    tries = []
    for count in range(1, 401):
        drafted = pol.drafts(16)
        if drafted:
            tries.append(count)
        pol.record(16, drafted, 28 if drafted else 16, 117.0 if drafted else 40.0)
    assert tries == [8, 16, 24, 40, 72, 136, 264, 392]
    assert not pol.rates(16).drafts


def test_recent_passes_only_so_a_change_moves_the_choice():
    pol = DraftPolicy(explore_every=100, keep=2, min_passes=2)
    for d, e, ms in ((True, 16, 20.0), (True, 16, 20.0), (False, 8, 15.0), (False, 8, 15.0)):
        pol.record(8, d, e, ms)
    assert pol.rates(8).drafts
    pol.record(8, True, 8, 30.0)  # acceptance fell: drafted passes now emit 1 per reader in 30 ms
    pol.record(8, True, 8, 30.0)
    assert not pol.rates(8).drafts


def test_bad_settings_and_empty_passes():
    with pytest.raises(ValueError):
        DraftPolicy(explore_every=1)
    with pytest.raises(ValueError):
        DraftPolicy(keep=2, min_passes=3)
    pol = DraftPolicy()
    pol.record(0, False, 0, 5.0)  # fed nobody: not a measurement
    pol.record(9, False, 9, 0.0)
    assert pol.rates(9).plain is None and pol.rates(9).drafted is None
    assert pol.rates(9).line() == ("At about 8 readers per pass the room is still measuring whether drafting pays "
                                   "(trying a plain pass now).")
