"""The one timer: warm-up calls untimed, the median of the timed ones, on the clock given."""

from graphpar.runtime.timing import median_seconds


def test_median_of_timed_calls_on_the_given_clock():
    durations = iter([5.0, 1.0, 9.0, 2.0, 3.0])  # the first call is the warm-up
    now = [0.0]
    calls = []

    def fn():
        calls.append(1)
        now[0] += next(durations)

    synced = []
    seconds = median_seconds(fn, 4, warmup=1, clock=lambda: now[0],
                             sync=lambda: synced.append(1))
    assert len(calls) == 5
    assert seconds == 2.5  # median of 1, 9, 2, 3: the warm-up's 5 is not among them
    assert len(synced) == 8  # before and after each timed call
