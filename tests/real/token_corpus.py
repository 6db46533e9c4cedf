# ruff: noqa: RUF001  (the corpus is Chinese and Japanese text: its full-width punctuation is the point)
"""The texts the token estimate (capacity_contract/tokens.py) is measured on against real
servers' ``usage.prompt_tokens`` (test_real_token_estimate.py, docs/router.md): English,
code, Chinese, Japanese, emoji, long repeated text, random letters and digits, JSON,
accented Latin, numbers. Each is well under 2,048 tokens (the tiny models' context) on
any tokenizer. Fixed texts, so that a figure can be reproduced."""

from __future__ import annotations

import base64
import hashlib
import json
import random

ENGLISH = (
    "The gateway admits each request against a budget that every handler process of the "
    "host shares. When the farm behind it is busy, a request waits in a queue, first in, "
    "first out, until a slot becomes free; when the queue is full, it is refused at once "
    "with a status that tells the client when to come back. Operators asked for this "
    "because their servers did not fail on the number of requests but on the tokens those "
    "requests held: a long document and a short question each took one slot, and the "
    "server ran out of memory for its cache long before it ran out of slots. So the "
    "budget now counts tokens too, estimated from the text of each request before it is "
    "sent, and reconciled against what the server reports after every poll."
)

CODE = '''def pump(provider: Provider, now: float) -> list[Grant]:
    """Grant the head of the queue while the limit allows."""
    grants: list[Grant] = []
    while provider.queue and provider.running < provider.limit:
        head = provider.queue[0]
        if head.deadline <= now:
            provider.queue.popleft()
            continue
        if not fits(provider, head.tokens):
            break  # strict order: nobody passes a head that does not fit
        provider.queue.popleft()
        provider.running += 1
        provider.tokens_running += head.tokens
        grants.append(Grant(head.ticket, now))
    return grants


for i, row in enumerate(sorted(rows, key=lambda r: (-r["limit"], r["id"]))):
    print(f"{i:>3} {row['id']:<24} {row['limit']:>5} {row.get('tokens', 0):>8}")
'''

CHINESE = (
    "网关在每个请求到达时检查整个主机共享的预算。当后端繁忙时，请求按照先来先服务的顺序排队等待，"
    "直到有空闲的位置；当队列已满时，请求会被立即拒绝，并告诉客户端何时重试。运维人员提出这个需求，"
    "是因为服务器并不是在请求数量上出问题，而是在这些请求占用的词元上出问题：一篇长文档和一个简短的"
    "问题各占一个位置，而服务器的缓存内存早在位置用完之前就耗尽了。"
)

JAPANESE = (
    "ゲートウェイは、ホスト上のすべてのハンドラープロセスが共有する予算に対して各リクエストを"
    "受け付けます。サーバーが混雑しているときは、リクエストは空きが出るまで順番に待ちます。"
    "キューがいっぱいの場合は、すぐに拒否され、クライアントにいつ再試行すべきかを伝えます。"
)

EMOJI = (
    "Shipped it 🚀🚀🚀 thanks team 🙏🏽 — the budget holds now 🎉 👨‍👩‍👧‍👦 family plan, "
    "🇯🇵🇫🇷🇧🇷 flags, 👍🏻👍🏼👍🏽👍🏾👍🏿 thumbs, ❤️‍🔥 and 🧑‍💻 at work; weather ☀️🌧️⛈️🌈 "
    "food 🍣🍜🍕🥐 ok ✅ no ❌ maybe 🤔🤷‍♀️"
)

REPEATED_SENTENCE = "All work and no play makes Jack a dull boy. " * 30

REPEATED_LETTERS = "ha" * 300 + " " + "a" * 400

REPEATED_SYMBOLS = "=" * 200 + "\n" + "-" * 200 + "\n" + "." * 200


def _random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


BASE64 = base64.b64encode(_random_bytes(600, 47)).decode()

HEX = " ".join(hashlib.sha256(str(i).encode()).hexdigest() for i in range(12))

RANDOM_LETTERS = "".join(
    random.Random(48).choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    for _ in range(800)
)

JSON_SCHEMA = json.dumps(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "string",
                        "description": "The city and state, e.g. San Francisco, CA",
                    },
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location"],
            },
        },
    },
    indent=2,
)

ACCENTED = (
    "Le passage à l'échelle exige que chaque requête soit comptée une fois, même quand "
    "le processus meurt. Die Warteschlange hält die Reihenfolge ein; große Anfragen "
    "überholen keine kleinen. El límite se publica cada segundo y caduca después de "
    "treinta; así ningún proceso muerto deja un límite en vigor."
)

NUMBERS = ", ".join(f"{(i * 7919) % 100003 / 97:.5f}" for i in range(150))

CORPUS: dict[str, str] = {
    "english": ENGLISH,
    "code": CODE,
    "chinese": CHINESE,
    "japanese": JAPANESE,
    "emoji": EMOJI,
    "repeated sentence": REPEATED_SENTENCE,
    "repeated letters": REPEATED_LETTERS,
    "repeated symbols": REPEATED_SYMBOLS,
    "base64": BASE64,
    "hex": HEX,
    "random letters": RANDOM_LETTERS,
    "json": JSON_SCHEMA,
    "accented": ACCENTED,
    "numbers": NUMBERS,
}
