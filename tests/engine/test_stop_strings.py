import pytest

from engine.errors import InvalidRequestError
from engine.stop_strings import StopResult, StopStringMatcher


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, StopResult]:
    """Concatenated emitted text and the last result, feeding until a stop."""
    out = []
    result = StopResult("", False, None)
    for delta in deltas:
        result = matcher.feed(delta)
        out.append(result.text_to_emit)
        if result.stopped:
            break
    return "".join(out), result


def test_text_without_stop_passes_through_unchanged():
    m = StopStringMatcher(("STOP",))
    assert m.feed("hello ") == StopResult("hello ", False, None)
    assert m.feed("world") == StopResult("world", False, None)
    assert m.flush() == ""


def test_stop_within_one_delta_emits_text_before_it():
    m = StopStringMatcher(("STOP",))
    assert m.feed("abcSTOPdef") == StopResult("abc", True, "STOP")


def test_stop_spanning_many_deltas_is_never_emitted():
    m = StopStringMatcher(("</end>",))
    emitted = []
    for delta in ["Hi <", "/", "en", "d", ">tail"]:
        r = m.feed(delta)
        emitted.append(r.text_to_emit)
        assert "<" not in r.text_to_emit  # every piece of the stop was held back
    assert "".join(emitted) == "Hi "
    assert r == StopResult("", True, "</end>")


def test_held_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    m = StopStringMatcher(("STOP",))
    assert m.feed("aST") == StopResult("a", False, None)
    assert m.feed("x") == StopResult("STx", False, None)


def test_stop_at_start_emits_nothing():
    m = StopStringMatcher(("###",))
    assert m.feed("###rest") == StopResult("", True, "###")


def test_include_stop_str_in_output_emits_the_stop_too():
    m = StopStringMatcher(("STOP",), include_stop_str_in_output=True)
    text, r = feed_all(m, ["abc ST", "OP after"])
    assert text == "abc STOP"
    assert r.stopped and r.stop_str == "STOP"


def test_overlapping_prefix_still_matches():
    # "aab" must match in "aaab" although the first held "aa" is not where it starts.
    m = StopStringMatcher(("aab",))
    text, r = feed_all(m, ["x", "a", "a", "a", "b", "y"])
    assert text == "xa"
    assert r == StopResult("", True, "aab")


def test_earliest_stop_wins_over_order_given():
    m = StopStringMatcher(("world", "lo"))
    assert m.feed("hello world") == StopResult("hel", True, "lo")


def test_longest_stop_wins_on_same_start():
    m = StopStringMatcher(("ab", "abc"), include_stop_str_in_output=True)
    assert m.feed("xabcd") == StopResult("xabc", True, "abc")


def test_hold_back_uses_longest_partial_across_stops():
    m = StopStringMatcher(("xyz", "yz!"))
    assert m.feed("axy") == StopResult("a", False, None)  # "xy" could start "xyz"
    assert m.feed("z") == StopResult("", True, "xyz")


def test_flush_releases_held_text_when_no_stop_matched():
    m = StopStringMatcher(("STOP",))
    assert m.feed("end ST") == StopResult("end ", False, None)
    assert m.flush() == "ST"
    assert m.flush() == ""


def test_after_stop_nothing_more_is_emitted():
    m = StopStringMatcher(("STOP",))
    m.feed("aSTOP")
    assert m.is_stopped
    assert m.feed("more text") == StopResult("", True, "STOP")
    assert m.flush() == ""


def test_no_stops_holds_nothing():
    m = StopStringMatcher(())
    assert m.feed("abc") == StopResult("abc", False, None)


def test_empty_stop_string_is_rejected():
    with pytest.raises(InvalidRequestError):
        StopStringMatcher(("",))
