"""Stop conditions of one sequence: token ids, stop strings across deltas, hold-back, min/max tokens."""

from __future__ import annotations

from stageserve.reclaim.stop_checker import StopChecker
from stageserve.v1 import common_pb2

EOS = 2


def checker(**stop_params) -> StopChecker:
    stop_params.setdefault("max_tokens", 100)
    return StopChecker(common_pb2.StopParams(**stop_params), eos_token_ids=[EOS])


def feed(stops: StopChecker, deltas: list[str], first_token: int = 1) -> list[tuple[str, str | None]]:
    return [stops.scan(delta, n) for n, delta in enumerate(deltas, start=first_token)]


def test_eos_stops_unless_ignore_eos():
    assert checker().stop_token(EOS, 1) == EOS
    assert checker().stop_token(7, 1) is None
    assert checker(ignore_eos=True).stop_token(EOS, 1) is None


def test_stop_token_ids_stop_even_with_ignore_eos():
    stops = checker(stop_token_ids=[7, 9], ignore_eos=True)
    assert stops.stop_token(9, 1) == 9
    assert stops.stop_token(EOS, 1) is None


def test_min_tokens_ignores_stop_ids_before_it():
    stops = checker(min_tokens=3, stop_token_ids=[7])
    assert stops.stop_token(EOS, 1) is None
    assert stops.stop_token(7, 2) is None
    assert stops.stop_token(EOS, 3) == EOS  # the count includes the token being checked


def test_max_tokens():
    stops = checker(max_tokens=3)
    assert not stops.length_reached(2)
    assert stops.length_reached(3)


def test_stop_string_across_deltas_is_found_and_not_leaked():
    stops = checker(stop=["###"])
    assert feed(stops, ["Hello", " #", "#", "# after"]) == [("Hello", None), (" ", None), ("", None), ("", "###")]


def test_held_tail_is_released_when_it_stops_matching():
    stops = checker(stop=["###"])
    assert feed(stops, ["ab#", "#", "c", "d"]) == [("ab", None), ("", None), ("##c", None), ("d", None)]


def test_held_tail_is_released_at_finish():
    stops = checker(stop=["STOP"])
    assert stops.scan("the end ST", 1) == ("the end ", None)
    assert stops.release("!") == "ST!"
    assert stops.release() == ""


def test_include_stop_str_in_output_keeps_the_stop_string():
    stops = checker(stop=["</a>"], include_stop_str_in_output=True)
    assert feed(stops, ["x </", "a> tail"]) == [("x ", None), ("</a>", "</a>")]


def test_text_after_the_stop_string_in_the_same_delta_is_dropped():
    assert checker(stop=["\n\n"]).scan("one\n\ntwo", 1) == ("one", "\n\n")


def test_first_ending_stop_string_wins():
    stops = checker(stop=["cdef", "de", "bcd"])
    assert stops.scan("abcdefg", 1) == ("a", "bcd")  # ends at 4; "de" at 5, "cdef" at 6


def test_min_tokens_ignores_stop_strings_before_it_but_keeps_straddling_ones():
    stops = checker(stop=["END"], min_tokens=3)
    assert feed(stops, ["x END y", "EN", "D z"]) == [("x END y", None), ("", None), ("", "END")]


def test_no_stop_strings_pass_text_through():
    stops = checker()
    assert stops.scan("anything ###", 1) == ("anything ###", None)
    assert stops.release() == ""


def test_empty_stop_string_is_ignored():
    assert checker(stop=[""]).scan("text", 1) == ("text", None)
