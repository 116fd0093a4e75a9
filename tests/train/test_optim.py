import math

import pytest

from flashdraft.train.optim import warmup_cosine


@pytest.mark.parametrize("total, ratio", [(100, 0.04), (7, 0.5), (1, 0.04)])
def test_warmup_then_cosine(total, ratio):
    f = warmup_cosine(total, ratio)
    warmup = max(1, round(total * ratio))
    assert f(0) == pytest.approx(1 / warmup)
    assert f(warmup - 1) == pytest.approx(1.0)
    values = [f(s) for s in range(warmup, total)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))  # non-increasing after warm-up
    if total > warmup:
        assert f(total) == pytest.approx(0.0, abs=1e-12)  # the cosine ends at the floor


def test_floor_and_no_warmup():
    f = warmup_cosine(10, 0.0, min_lr_ratio=0.1)
    assert f(0) == pytest.approx(1.0)
    assert f(5) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(10) == pytest.approx(0.1)
