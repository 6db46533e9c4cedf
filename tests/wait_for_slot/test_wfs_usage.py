"""wait-for-slot usage errors: exit 2 with a one-line reason, nothing sent (R-W2)."""

from __future__ import annotations

import pytest

# a regression that turns one sample into a 600 s wait should fail fast, not hang
pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--limit", "0"], "--limit must be at least 1"),
        (["--limit", "-3"], "--limit must be at least 1"),
        (["--need", "0"], "--need must be at least 1"),
        (["--need", "7"], "--need 7 can never fit under --limit 6"),
        (["--need", "3", "--limit", "2"], "--need 3 can never fit under --limit 2"),
        (["--interval", "0"], "--interval must be more than 0"),
        (["--interval", "nan"], "--interval must be a finite number"),
        (["--interval", "inf"], "--interval must be a finite number"),
        (["--max-wait", "-1"], "--max-wait must be 0 or more"),
        (["--timeout", "0"], "--timeout must be more than 0"),
    ],
)
def test_r_w2_bad_numbers_are_usage_errors(server, cli, extra, words):
    ran = cli("--url", server.url, "--model", "m", *extra)
    assert ran.code == 2
    assert words in ran.stderr
    assert len(ran.stderr.strip().splitlines()) == 1
    assert server.requests == []


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--model", "m"], "give --url BASE and --model M"),
        (["--url", "http://127.0.0.1:9"], "give --url BASE and --model M"),
        ([], "give --url BASE and --model M"),
        (["--url", "ftp://127.0.0.1/", "--model", "m"], "--url must be http://"),
        (["--url", "127.0.0.1:8080", "--model", "m"], "--url must be http://"),
        (["--url", "http://127.0.0.1:99999", "--model", "m"], "--url has an invalid port"),
        (["--url", "http://127.0.0.1/?a=1", "--model", "m"], "query or a fragment"),
        (["--model", "../v1/chat/completions", "--url", "http://127.0.0.1"], "--model must be"),
        (["--model", "/m", "--url", "http://127.0.0.1"], "--model must be"),
        (["--provider", "p", "--url", "http://127.0.0.1"], "--url is for metrics mode"),
        (["--provider", "p", "--segment", "/gwcap1-x", "--limit", "4"], "--limit is for metrics"),
        (["--provider", "p", "--key-env", "K"], "--key-env is for metrics mode"),
        (["--provider", "p"], "no segment: give --config PATH or --segment NAME"),
    ],
)
def test_r_w2_bad_targets_are_usage_errors(cli, argv, words):
    ran = cli(*argv)
    assert ran.code == 2
    assert words in ran.stderr
    assert len(ran.stderr.strip().splitlines()) == 1


def test_r_w3_credentials_in_the_url_are_refused_and_not_echoed(server, cli):
    url = server.url.replace("http://", "http://user:sk-in-url-1234@")
    ran = cli("--url", url, "--model", "m")
    assert ran.code == 2
    assert "must not carry credentials" in ran.stderr
    assert "sk-in-url-1234" not in ran.stderr
    assert server.requests == []


def test_r_w2_argparse_errors_exit_2(cli):
    ran = cli("--url", "http://127.0.0.1", "--model", "m", "--limit", "six")
    assert ran.code == 2
    assert "invalid int value" in ran.stderr


def test_r_w2_abbreviated_options_are_not_accepted(server, cli):
    # with abbreviations "--key-e" would work, and "--key" would be ambiguous and echoed
    ran = cli("--url", server.url, "--model", "m", "--key-e", "K")
    assert ran.code == 2
    assert server.requests == []


def test_help_lists_the_exit_codes(cli):
    ran = cli("--help")
    assert ran.code == 0
    for words in ("Exit 1", "Exit 2", "--key-env", "--key-file", "--check", "--max-wait"):
        assert words in ran.stdout
    assert "--api-key" not in ran.stdout  # the refusing options are hidden
