"""The pass roofline with two arithmetic ceilings (engine/explain/arithmetic_roofline.py), against hand-computed values."""

import pytest

from engine.errors import InputError
from engine.explain.arithmetic_roofline import floor_ratios, pass_floor_ms, regime, ridge_tokens


def test_floor_and_ridge_by_hand():
    # 100 MB at 20 GB/s: 5 ms to read; 100 M multiply-adds a token at 200 G/s: 0.5 ms a token → ridge at k = 10
    w, p, bw, peak = 100e6, 100e6, 20.0, 200.0
    assert pass_floor_ms(1, w, p, bw, peak) == pytest.approx(5.0)
    assert pass_floor_ms(10, w, p, bw, peak) == pytest.approx(5.0)
    assert pass_floor_ms(16, w, p, bw, peak) == pytest.approx(8.0)
    assert ridge_tokens(w, p, bw, peak) == pytest.approx(10.0)
    assert floor_ratios([1, 3, 20], w, p, bw, peak) == pytest.approx({1: 1.0, 3: 1.0, 20: 2.0})
    assert regime(3, w, p, bw, peak) == "memory-bound" and regime(12, w, p, bw, peak) == "compute-bound"
    # a 2.7× faster int8 ceiling moves the ridge 2.7× further out
    assert ridge_tokens(w, p, bw, 540.0) == pytest.approx(27.0)


def test_bad_input_is_a_clear_error():
    with pytest.raises(InputError):
        pass_floor_ms(0, 1, 1, 1, 1)
    with pytest.raises(InputError):
        ridge_tokens(1, 1, 0, 1)
