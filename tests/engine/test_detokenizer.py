"""Stop strings and the incremental detokenizer, over a byte-level fake vocabulary."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.detokenizer import IncrementalDetokenizer
from service.engine.stop import StopMatcher

EOS = 1000


def token_bytes(token_id: int) -> bytes:
    return b"<eos>" if token_id == EOS else bytes([token_id])


def byte_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def make(stops: tuple[str, ...] = ()) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(token_bytes, frozenset({EOS}), StopMatcher(stops))


def feed(detok: IncrementalDetokenizer, tokens: list[int]) -> str:
    out = ""
    for t in tokens:
        out += detok.push(t)
        if detok.stopped:
            break
    return out


def test_deltas_never_split_a_character() -> None:
    text = "a😀中文b é"
    detok = make()
    deltas = [detok.push(t) for t in byte_tokens(text)]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    # The emoji's four bytes produce nothing until the last one, then the whole char.
    assert deltas[1:5] == ["", "", "", "😀"]
    assert deltas[5:8] == ["", "", "中"]
    assert all("\ufffd" not in d for d in deltas)


def test_invalid_bytes_decode_like_a_full_decode() -> None:
    raw = [0x61, 0xFF, 0xE4, 0xB8, 0x62, 0xF0, 0x9F]  # stray byte, truncated CJK, truncated emoji
    detok = make()
    out = "".join(detok.push(t) for t in raw) + detok.flush()
    assert out == bytes(raw).decode("utf-8", errors="replace")
    assert out == "a\ufffd\ufffdb\ufffd"


def test_special_tokens_have_no_text() -> None:
    detok = make()
    assert detok.push(ord("x")) == "x"
    assert detok.push(EOS) == ""
    assert detok.flush() == ""


def test_stop_string_split_across_tokens_is_held_back_then_trimmed() -> None:
    detok = make(("STOP",))
    pieces = ["he", "llo ST", "OP more"]
    deltas = []
    for piece in pieces:
        for t in byte_tokens(piece):
            deltas.append(detok.push(t))
            if detok.stopped:
                break
    assert "".join(deltas) == "hello "
    assert detok.stopped
    assert detok.text == "hello "
    assert detok.flush() == ""


def test_held_back_prefix_is_released_when_generation_ends_otherwise() -> None:
    detok = make(("STOP",))
    assert detok.push(ord("a")) == "a"
    assert detok.push(ord("S")) == ""
    assert detok.push(ord("T")) == ""
    assert detok.flush() == "ST"
    assert not detok.stopped


def test_false_start_is_emitted_once_it_cannot_be_a_stop() -> None:
    detok = make(("abc",))
    assert detok.push(ord("a")) == ""
    assert detok.push(ord("b")) == ""
    assert detok.push(ord("x")) == "abx"


def test_earliest_stop_wins_and_stops_need_not_be_ascii() -> None:
    detok = make(("世界", "xyz"))
    out = feed(detok, byte_tokens("hi 世界 xyz"))
    assert out == "hi "
    assert detok.stopped


def test_stop_matching_can_be_deferred_for_min_tokens() -> None:
    detok = make(("a",))
    assert detok.push(ord("a"), match_stops=False) == "a"
    assert not detok.stopped
    assert detok.push(ord("b")) == "b"
    assert detok.push(ord("a")) == ""
    assert detok.stopped


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="abST😀中 ", max_size=30),
    stops=st.lists(st.text(alphabet="abST😀中", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=40),
)
def test_streamed_text_is_a_stop_free_prefix(text: str, stops: list[str], cuts: list[int]) -> None:
    raw = text.encode("utf-8")
    # Tokens are runs of 1..5 bytes, so they cut through characters.
    tokens: list[bytes] = []
    i = 0
    for n in cuts * (len(raw) + 1):
        if i >= len(raw):
            break
        tokens.append(raw[i : i + n])
        i += n
    table = {k: b for k, b in enumerate(tokens)}
    detok = IncrementalDetokenizer(table.__getitem__, frozenset(), StopMatcher(tuple(stops)))
    out = ""
    for k in range(len(tokens)):
        delta = detok.push(k)
        assert "\ufffd" not in delta
        out += delta
        if detok.stopped:
            break
    out += detok.flush()
    assert text.startswith(out)
    if detok.stopped:
        assert any(text[len(out) :].startswith(s) for s in stops)
        assert not any(s in out for s in stops)
    else:
        assert out == text
        assert not any(s in text for s in stops)
