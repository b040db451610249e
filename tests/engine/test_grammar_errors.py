"""What a client is told of an llguidance error: its first part, not the parser's state dump."""

from __future__ import annotations

from ftrs.engine.grammar import MAX_REASON, brief

DUMP = ('parser error: Too many items (limit 50000; ff_tokens); try avoiding single-byte/short '
        'lexemes\n<state>\nTokens: ⟦{"⟧\n1 tokens, 0 bytes; grm_prefix: ""\nFlags:\nParser: {\n'
        '  "compute_time_us": 0,\n  "rows": 37502,\n  "cached_rows": 0,\n  "all_items": 50002\n}')


def test_the_state_dump_is_cut_and_long_reasons_are_capped() -> None:
    assert brief(DUMP) == ("parser error: Too many items (limit 50000; ff_tokens); try avoiding "
                           "single-byte/short lexemes")
    long = "failed to compile JSON schema: " + "x" * 2000
    out = brief(long)
    assert len(out) == MAX_REASON and out.endswith("...") and out.startswith(long[:100])
    assert brief("  plain reason \n") == "plain reason"
