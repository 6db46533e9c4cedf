"""The CLI never echoes an argument it does not know: it may be a pasted key (R-P7, R-W3)."""

from __future__ import annotations

from gwtest import run_cli


def test_unrecognized_arguments_are_refused_without_being_shown() -> None:
    out = run_cli("availability", "--segment", "/gwt-nothing", "sk-pasted-by-mistake-123")
    assert out.returncode == 2
    assert "unrecognized" in out.stderr
    assert "sk-pasted-by-mistake-123" not in out.stderr + out.stdout
    typo = run_cli("availability", "--segmnt", "/x", "--token=sk-abc-999")
    assert typo.returncode == 2
    assert "--segmnt" in typo.stderr and "--token=(not shown)" in typo.stderr
    assert "sk-abc-999" not in typo.stderr
