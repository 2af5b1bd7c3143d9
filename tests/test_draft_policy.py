"""engine.decoding.draft_policy: the room drafts where its own measured passes say drafting pays."""

import pytest

from engine.decoding.draft_policy import DraftPolicy, band


def test_bands_are_the_nearest_powers_of_two():
    assert [band(r) for r in (1, 2, 3, 5, 6, 11, 12, 15, 16, 22, 23, 32)] == [1, 2, 4, 4, 8, 8, 16, 16, 16, 16, 32, 32]
    with pytest.raises(ValueError):
        band(0)


def test_a_reader_alone_always_drafts():
    pol = DraftPolicy()
    for _ in range(30):
        assert pol.drafts(1)
        pol.record(1, True, 1, 100.0)  # drafting that never pays alone still drafts: alone is the reader's choice


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
    assert pol.drafts(4)  # another band measures on its own
    assert pol.drafts(1)


def test_few_readers_start_by_drafting_and_try_plain_next():
    pol = DraftPolicy()
    _pass(pol, 3, True, 6, 20.0)
    _pass(pol, 3, False, 3, 15.0)
    assert pol.rates(3).drafts  # 2 per reader in 20 ms against 1 in 15


def test_when_drafting_pays_it_keeps_drafting():
    """Drafted 2 tokens per reader in 20 ms (100/s), plain 1 in 15 ms (66.7/s): 0.67 of it, under 0.75, so the plain
    kind is tried every 4 × 2 = 8th decision; at 1 in 11 ms (90.9/s, over 0.75 of 100) every 2nd."""
    pol = DraftPolicy(explore_every=2, min_passes=2)
    _pass(pol, 4, True, 8, 20.0)
    _pass(pol, 4, True, 8, 20.0)  # two drafted passes (min_passes 2): now plain ones to compare
    _pass(pol, 4, False, 4, 15.0)
    _pass(pol, 4, False, 4, 15.0)
    assert pol.rates(4).drafts
    assert [pol.drafts(5) for _ in range(5)] == [True, True, True, False, True]  # decisions 5..9: 8 explores
    pol2 = DraftPolicy(explore_every=2, min_passes=2)
    for d, e, ms in ((True, 8, 20.0), (True, 8, 20.0), (False, 4, 11.0), (False, 4, 11.0)):
        _pass(pol2, 4, d, e, ms)
    assert [pol2.drafts(4) for _ in range(4)] == [True, False, True, False]  # decisions 5..8: 6 and 8 explore


def test_recent_passes_only_so_a_change_moves_the_choice():
    pol = DraftPolicy(explore_every=100, keep=2, min_passes=2)
    for d, e, ms in ((True, 8, 20.0), (True, 8, 20.0), (False, 4, 15.0), (False, 4, 15.0)):
        _pass(pol, 4, d, e, ms)
    assert pol.rates(4).drafts
    pol.record(4, True, 4, 30.0)  # acceptance fell: drafted passes now emit 1 per reader in 30 ms
    pol.record(4, True, 4, 30.0)
    assert not pol.rates(4).drafts


def test_bad_settings_and_empty_passes():
    with pytest.raises(ValueError):
        DraftPolicy(explore_every=1)
    with pytest.raises(ValueError):
        DraftPolicy(keep=2, min_passes=3)
    pol = DraftPolicy()
    pol.record(0, False, 0, 5.0)  # fed nobody: not a measurement
    pol.record(3, False, 3, 0.0)
    assert pol.rates(3).plain is None and pol.rates(3).drafted is None
    assert "still measuring" in pol.rates(3).line()
