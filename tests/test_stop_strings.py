"""Stop strings across delta boundaries: matched wherever the cut falls, never emitted."""

from __future__ import annotations

from llmserve.gateway.stop_strings import StopCheck, StopStringMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[list[str], str | None]:
    """Feed deltas until a match; return the emitted pieces and the matched stop string."""
    matcher = StopStringMatcher(stops)
    emitted: list[str] = []
    for delta in deltas:
        check = matcher.push(delta)
        emitted.append(check.text)
        if check.matched_stop is not None:
            return emitted, check.matched_stop
    emitted.append(matcher.flush())
    return emitted, None


def every_split(text: str) -> list[list[str]]:
    """All ways to cut `text` into two or three deltas, plus one delta per character."""
    splits = [[text], list(text)]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            splits.append([text[:i], text[i:j], text[j:]])
    return splits


def test_match_is_found_wherever_the_deltas_are_cut():
    for deltas in every_split("Paris. END of text"):
        emitted, matched = run(["END"], deltas)
        assert (matched, "".join(emitted)) == ("END", "Paris. "), deltas


def test_no_emitted_piece_ever_contains_part_of_the_stop_string():
    for deltas in every_split("a<|im_end|>b"):
        emitted, matched = run(["<|im_end|>"], deltas)
        assert (matched, "".join(emitted)) == ("<|im_end|>", "a"), deltas
        assert all("<" not in piece for piece in emitted), deltas


def test_text_that_could_start_a_stop_string_is_held_back():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("hello ST") == StopCheck("hello ")
    assert matcher.held_text == "ST"
    assert matcher.push("O") == StopCheck("")
    assert matcher.push("RY") == StopCheck("STORY")
    assert matcher.held_text == ""


def test_held_text_is_released_by_flush_when_the_stream_ends():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("the ST") == StopCheck("the ")
    assert matcher.flush() == "ST"


def test_longest_possible_prefix_is_held():
    # "abab" could still become "ababc": all four characters are held, not just "ab".
    matcher = StopStringMatcher(["ababc"])
    assert matcher.push("xabab") == StopCheck("x")
    assert matcher.push("c!") == StopCheck("", matched_stop="ababc")


def test_overlapping_restart_inside_a_partial_match():
    matcher = StopStringMatcher(["aab"])
    assert matcher.push("aa") == StopCheck("")
    assert matcher.push("a") == StopCheck("a")
    assert matcher.push("b") == StopCheck("", matched_stop="aab")


def test_first_completed_stop_string_wins_independent_of_chunking():
    # "b" completes at index 2, "abc" at index 3: "b" wins whether the text comes whole or not.
    assert run(["abc", "b"], ["xabc"]) == (["xa"], "b")
    assert run(["abc", "b"], ["x", "a", "b", "c"]) == (["x", "", "a"], "b")


def test_longer_stop_string_wins_a_tie_on_the_end_position():
    assert run(["c", "abc"], ["xabc"]) == (["x"], "abc")


def test_multiple_stop_strings_and_multi_byte_text():
    emitted, matched = run(["東京", "\n\n"], ["Cities: ", "北京 and 東", "京 more"])
    assert matched == "東京"
    assert "".join(emitted) == "Cities: 北京 and "


def test_no_stop_strings_passes_text_through():
    matcher = StopStringMatcher([])
    assert matcher.push("anything") == StopCheck("anything")
    assert matcher.flush() == ""


def test_no_match_emits_everything():
    emitted, matched = run(["zzz"], ["abc z", "z", "y"])
    assert matched is None
    assert "".join(emitted) == "abc zzy"
    assert emitted == ["abc ", "", "zzy", ""]
