"""The pure parts of wait-for-slot: the loop on a fake clock, and the parse (R-W1, R-W2)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_capacity.wait_for_slot import describe, wait_for_slot
from gateway_capacity.wfs_metrics import (
    Fatal,
    Load,
    MetricsError,
    NoAnswer,
    Sample,
    Unreachable,
    parse_load,
)


class FakeTime:
    """A clock that only moves when the loop sleeps or a sample takes time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.sampled_at: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def sampler(self, samples: Iterable[Sample], takes: float = 0.0):
        it = iter(samples)
        last: list[Sample] = []

        def sample() -> Sample:
            self.sampled_at.append(self.now)
            self.now += takes
            last[:] = [next(it, last[0] if last else Fatal("script ran out"))]
            return last[0]

        return sample


BUSY = Load(running=6, waiting=1, limit=6)
ROOM = Load(running=2, waiting=0, limit=6)


def run(time: FakeTime, samples: Iterable[Sample], *, takes: float = 0.0, **options: object):
    lines: list[str] = []
    result = wait_for_slot(
        time.sampler(samples, takes),
        progress=lines.append,
        clock=time.clock,
        sleep=time.sleep,
        **{"need": 1, "interval": 5.0, "max_wait": 600.0, **options},  # type: ignore[arg-type]
    )
    return result, lines


def test_r_w1_room_on_the_first_sample_returns_at_once():
    time = FakeTime()
    result, lines = run(time, [ROOM])
    assert (result.code, result.outcome, result.samples, time.sleeps) == (0, "room", 1, [])
    assert lines == ["running 2 + waiting 0 + need 1 = 3 <= limit 6: room"]


def test_r_w1_samples_every_interval_until_room():
    time = FakeTime()
    result, _ = run(time, [BUSY, NoAnswer("HTTP 503"), BUSY, ROOM])
    assert (result.code, result.samples) == (0, 4)
    assert time.sampled_at == [0.0, 5.0, 10.0, 15.0]


def test_r_w1_gives_up_with_a_last_sample_at_max_wait():
    time = FakeTime()
    result, lines = run(time, [BUSY] * 100, interval=5.0, max_wait=12.0)
    assert (result.code, result.outcome) == (1, "gave_up")
    assert time.sampled_at == [0.0, 5.0, 10.0, 12.0]  # the last pause is cut to the deadline
    assert lines[-1].endswith("gave up after 12 s")


def test_r_w1_a_slow_sample_counts_toward_max_wait():
    time = FakeTime()
    result, _ = run(time, [BUSY] * 100, interval=5.0, max_wait=12.0, takes=4.0)
    assert result.outcome == "gave_up"
    assert time.sampled_at == [0.0, 9.0]  # 0+4 s, sleep 5; 9+4 = 13 s is past 12 s


def test_r_w1_max_wait_zero_is_one_sample():
    time = FakeTime()
    result, _ = run(time, [BUSY, ROOM], max_wait=0.0)
    assert (result.outcome, result.samples, time.sleeps) == ("gave_up", 1, [])


@pytest.mark.parametrize(
    ("first", "code", "outcome"),
    [(ROOM, 0, "room"), (BUSY, 1, "no_room"), (NoAnswer("HTTP 429"), 1, "no_room")],
)
def test_r_w1_check_takes_exactly_one_sample(first, code, outcome):
    time = FakeTime()
    result, lines = run(time, [first, ROOM], check=True)
    assert (result.code, result.outcome, result.samples, time.sleeps) == (code, outcome, 1, [])
    assert len(lines) == 1


def test_r_w2_a_fatal_sample_stops_the_wait_even_without_check():
    time = FakeTime()
    result, lines = run(time, [BUSY, Fatal("not found (HTTP 404)"), ROOM])
    assert (result.code, result.outcome, result.samples) == (2, "error", 2)
    assert result.last == Fatal("not found (HTTP 404)")
    assert len(lines) == 1  # the reason is printed once by the CLI, not as progress


@pytest.mark.parametrize(
    ("running", "waiting", "need", "limit", "room"),
    [(0, 0, 1, 1, True), (5, 0, 1, 6, True), (3, 3, 1, 6, False), (0, 0, 2, 1, False),
     (0, 0, 1, 0, False), (2.0, 1.0, 3, 6, True)],
)  # fmt: skip
def test_r_w1_r_w4_room_is_running_plus_waiting_plus_need_within_limit(
    running, waiting, need, limit, room
):
    assert Load(running, waiting, limit).has_room(need) is room


def test_r_w1_json_result_names_the_reason_when_there_was_no_load():
    time = FakeTime()
    result, _ = run(time, [NoAnswer("no answer within 5 s")], check=True)
    assert result.as_json(need=1)["reason"] == "no answer within 5 s"
    assert result.as_json(need=1)["running"] is None


# --------------------------------------------------------------------------- parse


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    running=st.lists(st.integers(0, 4096), min_size=1, max_size=8),
    waiting=st.lists(st.integers(0, 4096), min_size=1, max_size=8),
)
def test_r_w1_parse_sums_every_engine(vllm_text, running, waiting):
    assert parse_load(vllm_text(running, waiting)) == (float(sum(running)), float(sum(waiting)))


def test_r_w1_parse_takes_the_gauges_in_any_order_and_untyped():
    text = (
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2\n'
        "some_other_metric 7\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1\n'
    )
    assert parse_load(text) == (4.0, 2.0)


def test_r_w1_parse_does_not_count_a_family_whose_name_only_starts_like_a_gauge(vllm_text):
    # the fixture text has vllm:num_requests_waiting_by_reason = 50 per engine
    assert parse_load(vllm_text([1], [2])) == (1.0, 2.0)


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-0.5"])
def test_r_w2_parse_rejects_values_that_are_not_counts(value):
    text = f"vllm:num_requests_running 1\nvllm:num_requests_waiting {value}\n"
    with pytest.raises(MetricsError, match="vllm:num_requests_waiting is"):
        parse_load(text)


def test_r_w2_parse_failure_on_the_last_line_is_caught(vllm_text):
    with pytest.raises(MetricsError, match="malformed"):
        parse_load(vllm_text() + "}{\n")


def test_r_w2_parse_error_reason_is_one_short_line():
    with pytest.raises(MetricsError) as caught:
        parse_load('vllm:num_requests_running{a="' + "x\n" * 5000 + " 1\n")
    assert "\n" not in str(caught.value)
    assert len(str(caught.value)) < 300


def test_r_w2_parse_names_the_missing_gauge():
    with pytest.raises(MetricsError, match="no vllm:num_requests_running gauge"):
        parse_load("vllm:num_requests_waiting 0\n")
    assert parse_load("vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n") == (0.0, 0.0)


def test_check_gives_up_at_once_when_the_only_sample_reached_nothing():
    time = FakeTime()
    result, _ = run(time, [Unreachable("cannot connect to http://x (connection refused)")],
                    check=True)  # fmt: skip
    assert (result.code, result.outcome, result.samples) == (2, "unreachable", 1)


def test_without_check_an_unreachable_server_is_no_room_and_sampling_goes_on():
    time = FakeTime()
    result, _ = run(
        time,
        [Unreachable("cannot connect"), Unreachable("cannot connect"), Load(0, 0, 6)],
        interval=1.0,
        max_wait=10.0,
    )
    assert (result.code, result.outcome, result.samples) == (0, "room", 3)
    assert describe(Unreachable("cannot connect"), 1).startswith("no answer: cannot connect")
    assert describe(NoAnswer("busy (HTTP 429)"), 1) == "no room: busy (HTTP 429)"


def test_r_w1_progress_says_seconds_as_a_person_reads_them():
    time = FakeTime()
    _, lines = run(time, [BUSY, ROOM], interval=5.0, max_wait=6.0, takes=0.0193)
    assert "(waited 0.02 s of 6 s)" in lines[0], lines
    assert "next sample in 5 s" in lines[0], lines
