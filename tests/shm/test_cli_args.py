"""The CLI never echoes an argument it does not know: it may be a pasted key (R-P7, R-W3)."""

from __future__ import annotations

from pathlib import Path

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


def test_a_mistyped_option_names_the_option_it_resembles_and_shows_a_file_value(
    tmp_path: Path,
) -> None:
    config = tmp_path / "my-gateway.json"
    config.write_text('{"providers": []}')
    out = run_cli("check-config", "--confg", str(config))
    assert out.returncode == 2
    assert "unknown option --confg; did you mean --config?" in out.stderr, out.stderr
    assert f"--confg {config}" in out.stderr  # the value is a file: worth seeing
    assert "not shown" not in out.stderr
    secret = run_cli("check-config", "--confg", "sk-pasted-as-a-value-4242")
    assert "did you mean --config?" in secret.stderr
    assert "sk-pasted-as-a-value-4242" not in secret.stdout + secret.stderr
    flag = run_cli("availability", "--jsn", "--segment", "/gwt-unused")
    assert "unknown option --jsn; did you mean --json?" in flag.stderr, flag.stderr


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


def test_a_mistyped_option_of_a_subcommand_prints_that_subcommands_usage() -> None:
    out = run_cli("router", "show", "--key-file", "/nonexistent", "--jsn")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: gateway-capacity router show ")
    watch = run_cli("watch", "--intervall", "2")
    assert watch.stderr.startswith("usage: gateway-capacity watch ")


def test_a_segment_name_copied_from_dev_shm_without_its_slash_is_accepted(
    segment_name: str,
) -> None:
    short = segment_name.removeprefix("/")
    missing = run_cli("availability", "--segment", short)
    assert missing.returncode == 3  # looked for the right name: there is none yet
    assert f"{segment_name}" in missing.stderr


def test_a_max_heartbeat_age_or_watch_interval_of_zero_is_refused() -> None:
    """0 s would call every sidecar stale, and a watch that never sleeps spins."""
    for args in (
        ("availability", "--check", "--max-heartbeat-age", "0"),
        ("availability", "--check", "--max-heartbeat-age", "nan"),
        ("watch", "--interval", "0"),
    ):
        out = run_cli(*args, "--segment", "/gwt-unused")
        assert out.returncode == 2, args
        assert "must be a number of seconds above 0" in out.stderr, out.stderr


def test_watch_options_have_help() -> None:
    out = run_cli("watch", "--help")
    assert "--interval S    seconds between refreshes" in " ".join(out.stdout.split("\n"))
    assert "stop after N refreshes" in out.stdout
