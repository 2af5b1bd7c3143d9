"""engine.explain.machine: one dated measurement of this machine's peaks, stored, re-measured on request."""

import datetime as dt

from engine.decoding.batch import MachinePeaks
from engine.explain.machine import stored_peaks


def test_measured_once_stored_dated_and_remeasured_on_request(tmp_path):
    calls = []

    def measure(device):
        calls.append(device)
        return MachinePeaks(bandwidth_gbs=32.7 + len(calls), peak_tflops=0.175, threads=2, device=device,
                            matmul_n=1024, copy_mb=128)

    f = tmp_path / "peaks.json"
    t = lambda: dt.datetime(2026, 12, 7, 14, 2)  # noqa: E731
    a = stored_peaks("cpu", path=f, measure=measure, cpu="AMD EPYC", threads=2, now=t)
    b = stored_peaks("cpu", path=f, measure=measure, cpu="AMD EPYC", threads=2, now=t)  # a restart reads the file
    assert calls == ["cpu"] and a.peaks == b.peaks and b.measured_at == "2026-12-07 14:02"
    assert b.words() == ("33.7 GB/s memory bandwidth and 175.0 GFLOP/s fp32 matmul, measured on this machine "
                         "(AMD EPYC, 2 threads) on 2026-12-07 14:02")
    c = stored_peaks("cpu", path=f, measure=measure, cpu="AMD EPYC", threads=2, remeasure=True, now=t)
    assert len(calls) == 2 and c.peaks.bandwidth_gbs == 34.7
    assert stored_peaks("cpu", path=f, measure=measure, cpu="AMD EPYC", threads=2).peaks.bandwidth_gbs == 34.7
    stored_peaks("cpu", path=f, measure=measure, cpu="AMD EPYC", threads=1, now=t)  # other threads: measured again
    assert len(calls) == 3


def test_a_damaged_store_measures_again(tmp_path):
    f = tmp_path / "peaks.json"
    f.write_text("not json")
    p = MachinePeaks(10.0, 0.1, 2, "cpu", 1024, 128)
    assert stored_peaks("cpu", path=f, measure=lambda d: p, cpu="X", threads=2).peaks == p
