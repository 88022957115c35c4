"""Token -> text streaming: split UTF-8 characters and stop strings across tokens and steps."""

from __future__ import annotations

from homespec.speculation.textstream import TextStream

PIECES = {0: b"Hello", 1: b" wor", 2: b"ld", 3: b"\n\n", 4: b"END", 5: b"\xe2\x82", 6: b"\xac", 7: b"E", 8: b"N", 9: b"D!"}


def run(tokens, stop):
    ts = TextStream(PIECES.__getitem__, stop)
    out = [ts.push(t) for t in tokens]
    return out, ts


def test_text_is_emitted_as_tokens_arrive_without_stop_strings():
    out, ts = run([0, 1, 2], [])
    assert out == ["Hello", " wor", "ld"]
    assert ts.flush() == ""


def test_split_utf8_character_is_held_until_complete():
    out, ts = run([5, 6], [])
    assert out == ["", "€"]


def test_stop_string_inside_one_token_cuts_text_before_it():
    out, ts = run([0, 3, 4, 0], ["\n\n"])
    assert "".join(out) == "Hello" and ts.stopped and ts.stop_matched == "\n\n"


def test_stop_string_spanning_tokens_is_never_emitted():
    out, ts = run([0, 7, 8, 9], ["END"])
    assert out == ["Hello", "", "", ""]
    assert ts.stopped


def test_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    out, ts = run([0, 7, 0], ["END"])
    assert out == ["Hello", "", "EHello"]
    assert not ts.stopped


def test_flush_releases_held_text_at_end_of_generation():
    out, ts = run([0, 7, 8], ["END"])
    assert "".join(out) == "Hello" and ts.flush() == "EN"


def test_earliest_of_several_stop_strings_wins():
    out, ts = run([0, 1, 2], ["ld", "wor"])
    assert "".join(out) == "Hello " and ts.stop_matched == "wor"
