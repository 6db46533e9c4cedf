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


def test_options_are_never_abbreviated_so_a_key_is_not_taken_for_a_path() -> None:
    """``router show --key K`` once matched ``--key-file`` by prefix and printed
    'cannot open key file K' (R-P7)."""
    for args in (
        ("router", "show", "--key", "sk-typed-as-key-777"),
        (
            "wait-for-slot",
            "--url",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--key",
            "sk-typed-as-key-777",
        ),
        ("availability", "--seg", "/gwt-x"),
    ):
        out = run_cli(*args)
        assert out.returncode == 2, args
        assert "sk-typed-as-key-777" not in out.stdout + out.stderr
