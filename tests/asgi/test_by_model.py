"""``provider=by_model`` under real uvicorn: the body's model picks the provider's budget
(SPEC section 8; R-C2 aliases, R-A1/R-A2/R-A4 per provider).

The config: ``p1`` (limit 1) names ``alias-1`` -> ``up-1``; ``p2`` (limit 2) names
``alias-2`` -> ``up-2`` and ``shared-alias`` -> ``up-2``. ``/v1/hold`` reads the whole
body, reports its sha256 and length (what the app saw), and holds until released.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from asgi_support import RawRequest, Server, StartServer
from gwtest import run_cli, wait_until


@pytest.fixture
def by_model_config(tmp_path: Path) -> Path:
    path = tmp_path / "gateway.json"
    path.write_text(
        json.dumps(
            {
                "maxConcurrent": 4,
                "providers": [
                    {"id": "p1", "maxConcurrent": 1, "models": {"alias-1": "up-1"}},
                    {
                        "id": "p2",
                        "maxConcurrent": 2,
                        "models": {"alias-2": "up-2", "shared-alias": "up-2"},
                    },
                ],
            }
        )
    )
    return path


def completion(model: Any, **extra: Any) -> bytes:
    # Not the canonical JSON spacing: the app must see these very bytes.
    return json.dumps({"model": model, "messages": [{"role": "user"}], **extra}, indent=1).encode()


def post(server: Server, name: str, body: bytes, **kw: Any) -> RawRequest:
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    return RawRequest(
        server.port, f"/v1/hold?name={name}", method="POST", body=body, headers=headers, **kw
    )


def counts(server: Server, provider: str) -> tuple[int, int]:
    p = server.provider(provider)
    return int(p["running"]), int(p["waiting"])  # type: ignore[call-overload]


def wait_counts(server: Server, expect: dict[str, tuple[int, int]], timeout: float = 10) -> None:
    seen: list[dict[str, tuple[int, int]]] = []

    def check() -> bool:
        seen.append({p: counts(server, p) for p in expect})
        return seen[-1] == expect

    assert wait_until(check, timeout=timeout, every=0.1), f"want {expect}, last {seen[-2:]}"


def holder_count(segment: str) -> int:
    out = run_cli("inspect", "--segment", segment, "--json")
    assert out.returncode == 0, out.stderr
    return len(json.loads(out.stdout)["holders"])


def admitted_totals(segment: str) -> dict[str, int]:
    """Each provider's ``admitted_total`` counter, as ``inspect --json`` reports it."""
    doc = json.loads(run_cli("inspect", "--segment", segment, "--json").stdout)
    return {p["id"]: p["counters"]["admitted_total"] for p in doc["providers"]}


def test_r_a1_by_model_each_model_waits_on_its_own_providers_budget(
    start_server: StartServer, by_model_config: Path
) -> None:
    server = start_server("uvicorn", config=by_model_config, by_model=True)
    bodies = {
        "a1": completion("alias-1", n=1),
        "b1": completion("alias-2", n=2),
        "a2": completion("alias-1", n=3),
        "b2": completion("shared-alias", n=4),
        "b3": completion("alias-2", n=5, pad="x" * 70_000),  # several body messages
        "a3": completion("alias-1", n=6),
    }
    reqs = {}
    for name, body in bodies.items():  # interleaved: p1, p2, p1, p2, p2, p1
        reqs[name] = post(server, name, body)
        time.sleep(0.1)
    # p1: limit 1 -> 1 running, 2 waiting; p2: limit 2 -> 2 running, 1 waiting
    wait_counts(server, {"p1": (1, 2), "p2": (2, 1)})
    for name in ("a1", "b1", "b2"):
        reqs[name].admitted_pid()
    server.release("a1")
    server.release("b1")
    wait_counts(server, {"p1": (1, 1), "p2": (2, 0)})
    server.release()
    for name, req in reqs.items():
        digest, length = req.body_line()
        assert (digest, length) == (hashlib.sha256(bodies[name]).hexdigest(), len(bodies[name]))
        assert req.read_all().endswith(b"done\n\r\n0\r\n\r\n")
    wait_counts(server, {"p1": (0, 0), "p2": (0, 0)})
    assert admitted_totals(server.segment) == {"p1": 3, "p2": 3}


def test_by_model_an_upstream_id_is_admitted_and_unknown_or_missing_models_pass_through(
    start_server: StartServer, by_model_config: Path
) -> None:
    server = start_server("uvicorn", config=by_model_config, by_model=True)
    upstream_id = post(server, "u", completion("up-1"))  # p1's upstream id, nobody's alias
    upstream_id.admitted_pid()
    wait_counts(server, {"p1": (1, 0), "p2": (0, 0)})
    # p1 is full now; requests that name no provider's model are not admitted at all
    passing = [
        post(server, "x", completion("no-such-model")),
        post(server, "y", completion(42)),
        post(server, "z", b'{"messages": []}'),
        RawRequest(server.port, "/v1/hold?name=g"),  # a GET: its body is not read
    ]
    for req in passing:
        req.admitted_pid()
    assert counts(server, "p1") == (1, 0) and counts(server, "p2") == (0, 0)
    server.release()
    for req in [upstream_id, *passing]:
        assert req.read_all().endswith(b"done\n\r\n0\r\n\r\n")
    wait_counts(server, {"p1": (0, 0), "p2": (0, 0)})


def test_by_model_refuses_an_oversize_body_413_and_a_body_that_is_not_a_json_object_400(
    start_server: StartServer, by_model_config: Path
) -> None:
    server = start_server("uvicorn", config=by_model_config, by_model=True)
    big = completion("alias-1", pad="x" * (1 << 20))

    def answer(req: RawRequest) -> tuple[int, dict[str, Any], bytes]:
        raw = req.read_all()
        head, _, body = raw.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), json.loads(body)["error"], head.lower()

    # by Content-Length: refused before a byte of the body is read
    status, error, head = answer(post(server, "big", big, send_body=False))
    assert status == 413 and error["code"] == "request_too_large"
    assert b"retry-after" not in head
    # chunked, no Content-Length: refused once the body read passes 1 MiB
    chunked = RawRequest(
        server.port,
        "/v1/hold?name=chunked",
        method="POST",
        headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
    )
    for i in range(0, len(big), 65536):
        part = big[i : i + 65536]
        try:
            chunked.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        except OSError:
            break  # the server answered and closed
    status, error, _ = answer(chunked)
    assert status == 413 and error["code"] == "request_too_large"
    for bad in (b"{not json", b"\xff\xfe", b'["alias-1"]', b'"alias-1"', b"[" * 100_000):
        status, error, _ = answer(post(server, "bad", bad))
        assert status == 400 and error["code"] == "invalid_json", bad
        assert error["type"] == "invalid_request_error"
    # a JSON body labelled text/plain is still read: a label is no way around the budget
    labelled = post(server, "t", completion("alias-1"), headers={"Content-Type": "text/plain"})
    labelled.admitted_pid()
    assert counts(server, "p1") == (1, 0)
    # a form is not read, and not admitted
    form = post(
        server,
        "f",
        b"model=alias-1",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    form.admitted_pid()
    assert counts(server, "p1") == (1, 0)
    server.release()
    labelled.read_all()
    form.read_all()
    wait_counts(server, {"p1": (0, 0), "p2": (0, 0)})
    assert holder_count(server.segment) == 0


def test_r_a4_by_model_a_client_that_leaves_while_its_body_is_read_or_while_it_waits_leaves_nothing(
    start_server: StartServer, by_model_config: Path
) -> None:
    server = start_server("uvicorn", config=by_model_config, by_model=True)
    held = post(server, "h", completion("alias-1"))
    held.admitted_pid()
    # leaves while its body is read: half a body, then gone
    body = completion("alias-1", pad="y" * 200_000)
    half = post(server, "half", body, send_body=False)
    half.send(body[: len(body) // 2])
    time.sleep(0.3)
    half.close()
    # leaves while it waits (p1's one slot is held)
    waiter = post(server, "w", completion("alias-1"))
    wait_counts(server, {"p1": (1, 1), "p2": (0, 0)})
    waiter.close()
    wait_counts(server, {"p1": (1, 0), "p2": (0, 0)}, timeout=3)
    assert holder_count(server.segment) == 1  # the held one alone
    # the freed slot goes to the next arrival, not to a departed client
    server.release("h")
    held.read_all()
    wait_counts(server, {"p1": (0, 0), "p2": (0, 0)})
    nxt = post(server, "n", completion("alias-1"))
    nxt.admitted_pid()
    server.release()
    nxt.read_all()
    wait_counts(server, {"p1": (0, 0), "p2": (0, 0)})
    assert holder_count(server.segment) == 0
    assert "Traceback" not in server.output()


def answer_of(req: RawRequest) -> tuple[int, dict[str, Any]]:
    raw = req.read_all()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


def test_r_a1_by_model_table_the_path_or_query_model_wins_and_forms_are_read_by_their_fields(
    start_server: StartServer, by_model_config: Path
) -> None:
    pytest.importorskip("starlette", reason="forms are read with Starlette's parser")
    server = start_server("uvicorn", config=by_model_config, by_model="table")
    # the path names p1's alias, the body p2's: the path wins, as in LiteLLM
    body = completion("alias-2")
    in_path = RawRequest(
        server.port,
        "/deployments/alias-1/hold?name=a",
        method="POST",
        body=body,
        headers={"Content-Type": "application/json"},
    )
    in_path.admitted_pid()
    wait_counts(server, {"p1": (1, 0), "p2": (0, 0)})
    form = b"messages=hi&model=alias-1&model=alias-2"  # the last field wins, as in dict(form)
    urlencoded = post(
        server, "u", form, headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    multipart_body = (
        b'--b0\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        b"Content-Type: audio/wav\r\n\r\nRIFF\x00\xff\r\n"
        b'--b0\r\nContent-Disposition: form-data; name="model"\r\n\r\nalias-2\r\n--b0--\r\n'
    )
    multipart = post(
        server, "m", multipart_body, headers={"Content-Type": "multipart/form-data; boundary=b0"}
    )
    wait_counts(server, {"p1": (1, 0), "p2": (2, 0)})
    for name, req, sent in (
        ("a", in_path, body),
        ("u", urlencoded, form),
        ("m", multipart, multipart_body),
    ):
        if name != "a":
            req.admitted_pid()
        assert req.body_line() == (hashlib.sha256(sent).hexdigest(), len(sent)), name
    # a model that cannot be read on a table route: refused, never passed on unadmitted
    for path, unreadable, kind in (
        ("/v1/hold?name=x", completion(None), "application/json"),
        ("/v1/hold?name=x", b"", "application/json"),
        ("/v1/hold?name=x", b"prompt=hi", "application/x-www-form-urlencoded"),
        ("/deployments//hold?name=x", b'{"messages": []}', "application/json"),
    ):
        req = RawRequest(
            server.port, path, method="POST", body=unreadable, headers={"Content-Type": kind}
        )
        status, error = answer_of(req)
        assert (status, error["code"]) == (400, "model_required"), (path, unreadable)
    broken = post(server, "x", b"--b0\r\n", headers={"Content-Type": "multipart/form-data"})
    status, error = answer_of(broken)
    assert (status, error["code"]) == (400, "invalid_form")
    assert counts(server, "p1") == (1, 0) and counts(server, "p2") == (2, 0)
    server.release()
    for req in (in_path, urlencoded, multipart):
        assert req.read_all().endswith(b"done\n\r\n0\r\n\r\n")
    # the query string's model wins over the body's too (FastAPI's query parameter)
    in_query = post(server, "q&model=alias-1", completion("alias-2"))
    assert in_query.read_all().endswith(b"done\n\r\n0\r\n\r\n")
    wait_counts(server, {"p1": (0, 0), "p2": (0, 0)})
    assert holder_count(server.segment) == 0
    assert admitted_totals(server.segment) == {"p1": 2, "p2": 2}


def test_by_model_table_a_request_whose_model_cannot_be_read_goes_to_the_named_default(
    start_server: StartServer, by_model_config: Path
) -> None:
    server = start_server(
        "uvicorn",
        config=by_model_config,
        by_model="table",
        env_extra={"GWT_BY_MODEL_DEFAULT": "p1"},
    )
    first = post(server, "d1", b'{"messages": []}')
    first.admitted_pid()
    second = post(server, "d2", b"")
    wait_counts(server, {"p1": (1, 1), "p2": (0, 0)})  # p1's limit of 1 holds them
    known = post(server, "k", completion("alias-2"))  # a readable model keeps its own
    known.admitted_pid()
    wait_counts(server, {"p1": (1, 1), "p2": (1, 0)})
    server.release()
    for req in (first, second, known):
        assert req.read_all().endswith(b"done\n\r\n0\r\n\r\n")
    wait_counts(server, {"p1": (0, 0), "p2": (0, 0)})
