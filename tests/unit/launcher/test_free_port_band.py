"""The free-port bands of parallel test lanes (tbmq_launcher.redis.port_band, scripts/test-lanes.sh): lane k of n
picks its free ports in the k-th of n disjoint bands, so two pytest sessions side by side never choose the same
port; unset means the whole range; a bad value is refused with a message naming the variable."""

from __future__ import annotations

import pytest
from tbmq_launcher.redis import PORT_BAND_ENV, RedisError, port_band

LOW, HIGH = 10000, 32767


def test_unset_or_empty_is_the_whole_range():
    assert port_band(None, LOW, HIGH) == (LOW, HIGH) == port_band("", LOW, HIGH)


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_the_bands_of_n_lanes_are_disjoint_in_order_and_inside_the_range(n):
    bands = [port_band(f"{k}/{n}", LOW, HIGH) for k in range(1, n + 1)]
    assert bands[0][0] == LOW and bands[-1][1] <= HIGH
    for (lo, hi), (next_lo, _) in zip(bands, bands[1:]):
        assert lo < hi < next_lo
    assert sum(hi - lo + 1 for lo, hi in bands) > (HIGH - LOW + 1) - n  # only the division's rest is left out


@pytest.mark.parametrize("value", ["0/2", "3/2", "2", "a/b", "1/0", "-1/2", "1/2/3"])
def test_a_bad_band_names_the_variable(value):
    with pytest.raises(RedisError, match=f"{PORT_BAND_ENV}=.*k/n"):
        port_band(value, LOW, HIGH)


def test_bands_too_narrow_for_the_range_are_refused():
    with pytest.raises(RedisError, match="too narrow"):
        port_band("1/200", LOW, HIGH)
