"""What `kvreuse profile costs` measures, on a tiny model with some timings replaced to be what a busy machine gives."""

from kvreuse.controller import measure
from kvreuse.controller.search import roofline_ratio
from kvreuse.model.runtime import LayerwiseModel


def test_one_slow_sample_of_few_rows_does_not_make_the_dense_curve_fall(make_tiny, monkeypatch):
    tiny_model = LayerwiseModel(make_tiny("llama"))
    measured = dict(zip(measure.ROW_GRID, [9e-3, 1e-4, 2e-4, 4e-3, 5e-4, 1e-3, 2e-3, 4e-3]))  # 8 and 128 rows slowed
    monkeypatch.setattr(measure, "_dense_seconds", lambda model, rows, repeats, qkv_only=False: measured[rows])
    samples = measure._attention_samples(tiny_model, repeats=1)
    monkeypatch.setattr(measure, "_attention_samples", lambda model, repeats: samples)
    compute = measure.measure_compute(tiny_model, repeats=1)
    assert compute.dense_seconds == [1e-4, 1e-4, 2e-4, 5e-4, 5e-4, 1e-3, 2e-3, 4e-3]
    assert compute.t_c > 0 and 0 < roofline_ratio(compute.t_c, 1e-6) <= 1
