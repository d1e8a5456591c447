"""The packed parity row's verdict: greedy identical, but for exact ties of the oracle."""

from __future__ import annotations

from tools.parity.checks import TIE_TOL, DecodeParity


def test_a_tie_passes_and_a_real_difference_fails() -> None:
    tie = DecodeParity(3, 4, 255, 256, 0.026, tied=1, flip_margins=(0.0002,))
    assert tie.greedy_ok
    assert tie.line("int4") == (
        "int4: greedy_identical=3/4 tied_within_0.001=1 top1_agree=255/256 "
        "max_abs_decode_logit_diff=0.026 oracle_margins_at_other_picks=0.0002"
    )
    # a prompt whose different pick the oracle preferred by more than TIE_TOL is not tied
    miss = DecodeParity(3, 4, 255, 256, 0.026, tied=0, flip_margins=(10 * TIE_TOL,))
    assert not miss.greedy_ok
    assert "tied" not in miss.line("x") and "margins_at_other_picks=0.01" in miss.line("x")
    assert DecodeParity(4, 4, 256, 256, 0.01).greedy_ok
