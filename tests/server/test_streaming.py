"""Stop strings: text is cut at the first stop string, even one spanning two blocks, and
nothing that could start one is sent early."""

from dilaserve.server.streaming import StopText


def test_no_stops_passes_everything():
    s = StopText([])
    assert s.feed("abc") == "abc" and s.feed("def", final=True) == "def"


def test_stop_inside_a_block():
    s = StopText(["23"])
    assert s.feed("80235", final=True) == "80" and s.stopped and s.text == "80"


def test_stop_spanning_blocks_is_held_back_then_cut():
    s = StopText(["END"])
    assert s.feed("hello E") == "hello"  # " E" is held: it could start the stop string
    assert s.feed("NDworld") == " "
    assert s.stopped and s.text == "hello "
    assert s.feed("more") == ""


def test_held_text_is_released_when_it_cannot_be_a_stop():
    s = StopText(["xyz"])
    assert s.feed("abcx") == "ab"
    assert s.feed("q") == "c"
    assert s.feed("", final=True) == "xq"
