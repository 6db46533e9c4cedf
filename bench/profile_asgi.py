"""Where a request's time goes in AdmissionMiddleware, in process, under cProfile.

    .venv/bin/python bench/profile_asgi.py [REF]

Calls the trivial app of ``asgi_bench_app`` directly (no server, no sockets), plain and
wrapped, 20,000 times each, and prints the time the middleware adds per request and the
top of a cProfile of the wrapped app, for this checkout and for ``handler_shim/asgi.py``
as of git ``REF`` (default: the revision before the fast path).
"""

import asyncio
import cProfile
import importlib.util
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
os.environ.setdefault("BENCH_CONFIG", os.devnull)  # asgi_bench_app builds its own at import

from asgi_bench_app import plain  # noqa: E402

from shm_layout import unlink_segment  # noqa: E402

REF = sys.argv[1] if len(sys.argv) > 1 else "340308d"
SCOPE = {"type": "http", "method": "GET", "path": "/", "headers": []}


def load(path: str | None) -> type:
    if path is None:
        from handler_shim.asgi import AdmissionMiddleware

        return AdmissionMiddleware
    spec = importlib.util.spec_from_file_location("asgi_" + os.urandom(2).hex(), path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.AdmissionMiddleware  # type: ignore[no-any-return]


def make_receive():  # type: ignore[no-untyped-def]
    sent: list[int] = []

    async def receive():  # type: ignore[no-untyped-def]
        if sent:
            return {"type": "http.disconnect"}
        sent.append(1)
        return {"type": "http.request", "body": b"", "more_body": False}

    return receive


async def send(message: object) -> None:
    pass


async def run(app, n: int) -> None:  # type: ignore[no-untyped-def]
    for _ in range(n):
        await app(dict(SCOPE), make_receive(), send)


async def main(config: str) -> None:
    before = os.path.join(tempfile.mkdtemp(), "asgi_before.py")
    with open(before, "wb") as f:
        f.write(
            subprocess.run(
                ["git", "show", f"{REF}:handler_shim/asgi.py"], cwd=ROOT, capture_output=True
            ).stdout
        )
    for label, path in ((f"at {REF}", before), ("this checkout", None)):
        mw = load(path)(plain, config=config, generation="profile", provider="bench")
        await mw.attach()
        await run(mw, 2000)
        t = time.perf_counter()
        await run(plain, 20000)
        base = (time.perf_counter() - t) / 20000
        t = time.perf_counter()
        await run(mw, 20000)
        per = (time.perf_counter() - t) / 20000
        print(
            f"middleware {label}: plain {base * 1e6:.2f} us, wrapped {per * 1e6:.2f} us, "
            f"added {(per - base) * 1e6:.2f} us per request"
        )
        profile = cProfile.Profile()
        profile.enable()
        await run(mw, 5000)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(8)
        await mw.detach()


if __name__ == "__main__":
    directory = tempfile.mkdtemp()
    config = os.path.join(directory, "gateway.json")
    with open(config, "w") as f:
        json.dump({"providers": [{"id": "bench", "maxConcurrent": 64}]}, f)
    segment = "/gwb-prof" + os.urandom(3).hex()
    os.environ["GATEWAY_CAPACITY_SEGMENT"] = segment
    try:
        asyncio.run(main(config))
    finally:
        unlink_segment(segment)
