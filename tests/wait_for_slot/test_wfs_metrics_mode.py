"""wait-for-slot metrics mode: the CLI against a real loopback server (R-W1, R-W2, R-W5)."""

from __future__ import annotations

import json
import os
import pty
import ssl
import subprocess

import pytest
import trustme

# a regression that turns one sample into a 600 s wait should fail fast, not hang
pytestmark = pytest.mark.timeout(60)

FAST = ("--interval", "0.05", "--timeout", "5")


def target(server, model: str = "workhorse") -> tuple[str, ...]:
    return ("--url", server.url, "--model", model)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


# --------------------------------------------------------------------------- room / busy


def test_r_w1_room_exits_0_after_one_get_of_the_metrics_path(server, cli, gauges):
    server.serve(gauges(running=[1, 1], waiting=[0, 1]))
    ran = cli(*target(server))
    assert ran.code == 0, ran.stderr
    assert [(r.method, r.path) for r in server.requests] == [("GET", "/upstream/workhorse/metrics")]
    assert "running 2 + waiting 1 + need 1 = 4 <= limit 6: room" in ran.stderr
    assert ran.stdout == ""


def test_r_w1_gauges_are_summed_over_every_engine_label_set(server, cli, gauges):
    # engine 0 alone (3 + 1 + 1 = 5) would fit under 6; the sum over engines (7) does not
    server.serve(gauges(running=[3, 2], waiting=[1, 0]))
    assert cli(*target(server), "--check").code == 1
    assert cli(*target(server), "--check", "--limit", "7").code == 0


@pytest.mark.parametrize(
    ("running", "code"),
    [(5, 0), (6, 1)],
    ids=["5_plus_need_1_fits_6", "6_plus_need_1_does_not"],
)
def test_r_w1_defaults_are_limit_6_need_1(server, cli, gauges, running, code):
    server.serve(gauges(running=[running], waiting=[0]))
    assert cli(*target(server), "--check").code == code


def test_r_w1_need_counts_toward_the_limit(server, cli, gauges):
    server.serve(gauges(running=[2], waiting=[1]))
    assert cli(*target(server), "--check", "--need", "3").code == 0  # 2 + 1 + 3 = 6
    assert cli(*target(server), "--check", "--need", "4").code == 1  # 7 > 6


def test_r_w1_check_busy_exits_1_after_exactly_one_sample(server, cli, gauges):
    server.serve(gauges(running=[4, 2], waiting=[1, 1]))
    ran = cli(*target(server), "--check", "--interval", "0.01")
    assert ran.code == 1
    assert len(server.requests) == 1
    assert "no room" in ran.stderr


def test_r_w1_waits_then_exits_0_when_room_appears(server, cli, gauges):
    busy, room = gauges(running=[6], waiting=[2]), gauges(running=[1], waiting=[0])
    server.serve(busy, busy, busy, room)
    ran = cli(*target(server), *FAST)
    assert ran.code == 0, ran.stderr
    assert len(server.requests) == 4
    # one progress line per sample when stderr is not a terminal
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 4
    assert all("no room" in line and "next sample in" in line for line in lines[:3])
    assert lines[3].endswith(": room")


def test_r_w1_gives_up_after_max_wait_with_exit_1(server, cli, gauges):
    server.serve(gauges(running=[6], waiting=[0]))
    ran = cli(*target(server), "--interval", "0.1", "--max-wait", "1.5")
    assert ran.code == 1
    assert ran.elapsed >= 1.5  # it did wait the whole --max-wait
    assert len(server.requests) >= 2  # the first at 0 s, ..., the last at 1.5 s
    assert "gave up after" in ran.stderr.strip().splitlines()[-1]


def test_r_w1_max_wait_0_takes_one_sample_and_gives_up(server, cli, gauges):
    server.serve(gauges(running=[9], waiting=[0]))
    ran = cli(*target(server), "--max-wait", "0")
    assert ran.code == 1
    assert len(server.requests) == 1


def test_r_w1_json_result_on_stdout(server, cli, gauges):
    server.serve(gauges(running=[2, 1], waiting=[0, 1]))
    ran = cli(*target(server), "--json", "--need", "2")
    assert ran.code == 0
    result = json.loads(ran.stdout)
    assert result == {
        "schema_version": 1,
        "outcome": "room",
        "exit_code": 0,
        "running": 3.0,
        "waiting": 1.0,
        "need": 2,
        "limit": 6,
        "reason": None,
        "samples": 1,
        "waited_s": result["waited_s"],
    }
    server.serve(gauges(running=[9], waiting=[0]))
    gave_up = json.loads(cli(*target(server), "--json", "--max-wait", "0").stdout)
    assert (gave_up["outcome"], gave_up["exit_code"]) == ("gave_up", 1)


def test_r_w1_quiet_prints_nothing_on_room_or_no_room(server, cli, gauges):
    server.serve(gauges(running=[0], waiting=[0]))
    ran = cli(*target(server), "--quiet")
    assert (ran.code, ran.stderr, ran.stdout) == (0, "", "")
    server.serve(gauges(running=[9], waiting=[0]))
    ran = cli(*target(server), "--quiet", "--interval", "0.05", "--max-wait", "0.1")
    assert (ran.code, ran.stderr, ran.stdout) == (1, "", "")


def test_progress_updates_one_line_in_place_on_a_terminal(server, gauges, cli_argv, cli_env):
    busy, room = gauges(running=[6], waiting=[0]), gauges(running=[0], waiting=[0])
    server.serve(busy, busy, room)
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.Popen(
            [*cli_argv, *target(server), *FAST],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=terminal,
            env=cli_env(),
        )
        os.close(terminal)
        seen = b""
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(timeout=30) == 0
    finally:
        os.close(controller)
    text = seen.decode()
    assert text.count("\r\x1b[K") == 3  # the same line rewritten for each of 3 samples
    assert text.replace("\r\n", "\n").count("\n") == 1  # and ended once
    assert text.rstrip().endswith(": room")


def test_r_w1_model_with_a_slash_keeps_it_in_the_path(server, cli, gauges):
    server.serve(gauges())
    assert cli("--url", server.url + "/", "--model", "Qwen/Qwen3-8B").code == 0
    assert server.requests[0].path == "/upstream/Qwen/Qwen3-8B/metrics"


def test_r_w1_base_url_path_prefix_is_kept(server, cli, gauges):
    server.serve(gauges())
    assert cli("--url", server.url + "/llama", "--model", "workhorse").code == 0
    assert server.requests[0].path == "/llama/upstream/workhorse/metrics"


def test_r_w1_ipv6_loopback_url(make_server, cli, gauges):
    server = make_server(ipv6=True)
    server.serve(gauges(running=[1], waiting=[0]))
    ran = cli(*target(server))
    assert ran.code == 0, ran.stderr
    assert len(server.requests) == 1


def test_r_w1_https_with_ca_file(make_server, cli, gauges, tmp_path):
    ca = trustme.CA()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    server = make_server(tls=context)
    server.serve(gauges(running=[1], waiting=[0]))
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    ran = cli(*target(server), "--ca-file", str(ca_file))
    assert ran.code == 0, ran.stderr
    # without the CA the certificate is not trusted: a configuration error, not "busy"
    untrusted = cli(*target(server), "--interval", "0.05", "--max-wait", "5")
    assert untrusted.code == 2
    assert "--ca-file" in one_line(untrusted.stderr)


# --------------------------------------------------------------------------- R-W2: no room


@pytest.mark.parametrize("status", [429, 500, 502, 503])
def test_r_w2_429_and_5xx_count_as_no_room_and_sampling_goes_on(
    server, cli, gauges, answer, status
):
    server.serve(answer(status, "try later"))
    checked = cli(*target(server), "--check")
    assert checked.code == 1
    assert f"HTTP {status}" in checked.stderr
    server.requests.clear()
    server.serve(answer(status, "try later"), answer(status, "try later"), gauges())
    ran = cli(*target(server), *FAST)
    assert ran.code == 0, ran.stderr
    assert len(server.requests) == 3


def test_check_against_a_port_nothing_listens_on_gives_up_at_once_with_exit_2(cli, closed_port):
    ran = cli("--url", f"http://127.0.0.1:{closed_port}", "--model", "m", "--check")
    assert ran.code == 2  # not 1 ("no room"): a wrong port is not a busy server
    line = one_line(ran.stderr)
    assert line.startswith("gateway-capacity: no answer: cannot connect to http://127.0.0.1:")
    assert "(connection refused)" in line and "no room" not in line
    as_json = cli("--url", f"http://127.0.0.1:{closed_port}", "--model", "m", "--check", "--json",
                  "--limit", "6")  # fmt: skip
    assert as_json.code == 2
    doc = json.loads(as_json.stdout)
    assert doc["outcome"] == "unreachable" and doc["error"].startswith("no answer: cannot connect")
    assert doc["limit"] == 6  # the one given, though no sample reported one


def test_r_w2_without_check_an_unreachable_server_is_said_as_no_answer_while_it_waits(
    cli, closed_port
):
    ran = cli("--url", f"http://127.0.0.1:{closed_port}", "--model", "m",
              "--interval", "0.05", "--max-wait", "0.3")  # fmt: skip
    assert ran.code == 1  # still no room (R-W2), and it gave up at --max-wait
    progress = [line for line in ran.stderr.splitlines() if line.startswith("wait-for-slot: ")]
    assert len(progress) >= 2
    assert all("no answer: cannot connect to" in line for line in progress)
    assert not any("no room" in line for line in progress)


def test_r_w2_a_server_that_never_answers_is_no_room_after_the_sample_deadline(server, cli, answer):
    server.serve(answer(hang=True))
    ran = cli(*target(server), "--check", "--timeout", "0.5")
    assert ran.code == 1
    assert "no answer within 0.5 s" in ran.stderr
    assert ran.elapsed < 20  # honest margin: the deadline held, it did not wait forever


def test_r_w2_the_sample_deadline_covers_a_body_that_never_ends(server, cli, answer):
    server.serve(answer(drip=True))
    ran = cli(*target(server), "--check", "--timeout", "0.5")
    assert ran.code == 1
    assert "no answer within 0.5 s" in ran.stderr
    assert ran.elapsed < 20


def test_r_w2_timeouts_repeat_until_max_wait(server, cli, answer):
    server.serve(answer(hang=True))
    ran = cli(*target(server), "--timeout", "0.2", "--interval", "0.05", "--max-wait", "1")
    assert ran.code == 1
    assert len(server.requests) >= 2


# --------------------------------------------------------------------------- R-W2: exit 2


@pytest.mark.parametrize(
    ("status", "words"),
    [
        (401, "unauthorized (HTTP 401): no key was sent"),
        (403, "forbidden (HTTP 403)"),
        (404, "not found (HTTP 404)"),
        (400, "HTTP 400"),
        (410, "HTTP 410"),
    ],
)
def test_r_w2_other_4xx_exit_2_with_a_one_line_reason(server, cli, answer, status, words):
    server.serve(answer(status, "no"))
    ran = cli(*target(server), *FAST)  # not --check: it must stop at once, not sample on
    assert ran.code == 2
    assert words in one_line(ran.stderr)
    # a 404 also asks whether the URL is a capacity router (GET /v1/load), once
    assert len(server.requests) == (2 if status == 404 else 1)


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_r_w2_redirect_exits_2_and_the_location_gets_nothing(
    make_server, cli, answer, gauges, status
):
    elsewhere = make_server()
    elsewhere.serve(gauges())
    server = make_server()
    server.serve(
        answer(status, headers={"Location": f"{elsewhere.url}/upstream/workhorse/metrics"})
    )
    ran = cli(*target(server), *FAST)
    assert ran.code == 2
    assert f"redirect refused (HTTP {status})" in one_line(ran.stderr)
    assert len(server.requests) == 1
    assert elsewhere.requests == []


def test_r_w2_answer_without_the_waiting_gauge_exits_2(server, cli, answer, vllm_text):
    server.serve(answer(body=vllm_text(running=[1], omit=["vllm:num_requests_waiting"])))
    ran = cli(*target(server), *FAST)
    assert ran.code == 2
    assert "no vllm:num_requests_waiting gauge" in one_line(ran.stderr)


def test_r_w2_answer_without_either_gauge_names_both(server, cli, answer, vllm_text):
    text = vllm_text(omit=["vllm:num_requests_waiting", "vllm:num_requests_running"])
    server.serve(answer(body=text))
    ran = cli(*target(server), *FAST)
    assert ran.code == 2
    assert "no vllm:num_requests_running and no vllm:num_requests_waiting" in one_line(ran.stderr)


@pytest.mark.parametrize(
    "body",
    [
        "<html><body>llama-swap</body></html>\n",
        'vllm:num_requests_running{engine="0" 1\n',
        "\x00\x01\x02 binary\n",
    ],
    ids=["html", "unclosed_labels", "binary"],
)
def test_r_w2_malformed_text_exits_2(server, cli, answer, body):
    server.serve(answer(body=body))
    ran = cli(*target(server), *FAST)
    assert ran.code == 2
    assert "malformed metrics text" in one_line(ran.stderr)


def test_r_w2_malformed_line_after_both_gauges_still_exits_2(server, cli, answer, vllm_text):
    # the parser is a generator: both gauges parse fine before the last line fails
    server.serve(answer(body=vllm_text(running=[0], waiting=[0]) + "vllm:broken{engine=\n"))
    ran = cli(*target(server), *FAST)
    assert ran.code == 2
    assert "malformed metrics text" in one_line(ran.stderr)


def test_r_w2_non_utf8_body_exits_2(server, cli, answer, vllm_text):
    server.serve(answer(body=vllm_text().encode() + b"# HELP x caf\xe9\n"))
    ran = cli(*target(server), *FAST)
    assert ran.code == 2
    assert "not UTF-8" in one_line(ran.stderr)


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-1.0"])
def test_r_w2_a_gauge_that_is_not_a_count_exits_2(server, cli, answer, vllm_text, value):
    text = vllm_text(running=[1, 2], waiting=[0, 0]).replace(
        'vllm:num_requests_waiting{engine="1",model_name="workhorse"} 0.0',
        f'vllm:num_requests_waiting{{engine="1",model_name="workhorse"}} {value}',
    )
    assert value in text
    server.serve(answer(body=text))
    ran = cli(*target(server), *FAST)
    assert ran.code == 2
    assert "vllm:num_requests_waiting is" in one_line(ran.stderr)


def test_r_w2_body_over_4_mib_exits_2(server, cli, answer, vllm_text):
    padding = "# HELP padding " + "x" * (4 * 1024 * 1024) + "\n"
    server.serve(answer(body=vllm_text() + padding))
    ran = cli(*target(server), *FAST)
    assert ran.code == 2
    assert "larger than 4194304 bytes" in one_line(ran.stderr)


def test_r_w2_body_over_4_mib_without_content_length_is_cut_while_streaming(
    server, cli, answer, vllm_text
):
    padding = "# HELP padding " + "x" * (4 * 1024 * 1024) + "\n"
    server.serve(answer(body=vllm_text() + padding, no_length=True))
    ran = cli(*target(server), *FAST)
    assert ran.code == 2
    assert "larger than" in one_line(ran.stderr)


# --------------------------------------------------------------------------- R-W5


def test_r_w5_every_sample_is_one_get_and_nothing_else(server, cli, gauges):
    busy = gauges(running=[6], waiting=[0])
    server.serve(busy, busy, gauges())
    assert cli(*target(server), *FAST).code == 0
    assert [(r.method, r.path) for r in server.requests] == [
        ("GET", "/upstream/workhorse/metrics")
    ] * 3
    assert all("content-length" not in r.headers for r in server.requests)


def test_r_w5_proxy_environment_is_ignored(make_server, cli, gauges, cli_env):
    server, proxy = make_server(), make_server()
    server.serve(gauges())
    proxy.serve(gauges(running=[99], waiting=[0]))
    env = cli_env(
        HTTP_PROXY=proxy.url, http_proxy=proxy.url, ALL_PROXY=proxy.url, all_proxy=proxy.url
    )
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    ran = cli(*target(server), "--check", env=env)
    assert ran.code == 0, ran.stderr
    assert (len(server.requests), proxy.requests) == (1, [])


# --------------------------------------------------------------------------- the installed command


def test_installed_command_exits_0_1_2_as_a_real_process(make_server, cli_process, gauges, answer):
    room, busy, gone = make_server(), make_server(), make_server()
    room.serve(gauges(running=[1, 0], waiting=[0, 0]))
    busy.serve(gauges(running=[3, 3], waiting=[0, 1]))
    gone.serve(answer(404, "no such model"))
    assert cli_process(*target(room)).code == 0
    assert cli_process(*target(busy), "--interval", "0.05", "--max-wait", "0.2").code == 1
    ran = cli_process(*target(gone))
    assert ran.code == 2
    assert "not found (HTTP 404)" in one_line(ran.stderr)
    assert "Traceback" not in ran.stderr


def test_r_w2_a_compressed_answer_exits_2_without_being_inflated(server, cli, answer, vllm_text):
    """We ask for identity; a gzip body would only be measured after inflating it."""
    import gzip

    server.serve(
        answer(body=gzip.compress(vllm_text().encode()), headers={"Content-Encoding": "gzip"})
    )
    ran = cli(*target(server), *FAST)
    assert ran.code == 2
    assert "compressed (gzip)" in one_line(ran.stderr)


def test_r_w2_a_body_that_will_not_decode_is_a_one_line_exit_2(server, cli, answer):
    server.serve(answer(body=b"not gzip at all", headers={"Content-Encoding": "gzip"}))
    ran = cli(*target(server), *FAST)
    assert ran.code == 2
    assert "Traceback" not in ran.stderr


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/x\ty", "http://xn--a.com:9"])
def test_r_w2_an_unusable_url_is_a_usage_error(cli, url):
    ran = cli("--url", url, "--model", "m", "--check")
    assert ran.code == 2
    assert "--url is not a valid URL" in one_line(ran.stderr)


@pytest.mark.parametrize(
    "bad",
    [
        {"body": 'vllm:num_requests_running{engine="0"} 1\n\x1b[2Jforged line \u202e\n'},
        {"body": "x 1\n", "headers": {"Content-Encoding": "gz\x9b[2J"}},
    ],
    ids=["body", "content_encoding"],
)
def test_r_w2_what_the_server_says_is_shown_escaped(server, cli, answer, bad):
    """A metrics body or header quoted in an error reaches the terminal escaped: no
    ESC, no C1 CSI (U+009B), no bidi mark."""
    server.serve(answer(**bad))
    ran = cli(*target(server), *FAST)
    assert ran.code == 2
    said = ran.stdout + ran.stderr
    assert not any(ch in said for ch in "\x1b\x9b\u202e"), repr(said)
