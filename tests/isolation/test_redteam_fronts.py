"""Load on the fronts before any work is admitted: what a tenant (or nobody) can make the
server do with bodies, refusals and connections alone.

Each attack runs while tenant ``victim`` streams short greedy requests over gRPC, on the
server of ``test_redteam_neighbours`` (the fixtures are shared); the victim's gap p50/p90 and
TTFT are judged against its baseline in ``make verify`` (``_judge_flood``) and recorded in the
short run. Each row also checks the mechanism that bounds the attack, at both sizes:

- an 8 MiB ``/v1/completions`` body is refused from its size (413) before it is parsed;
- a wrong-key request is answered 401 and its connection closed: nothing pipelined behind
  it is read;
- a ``logit_bias`` of 700k entries (7.7 MB) is refused without its entries being parsed;
- a chat history with 7 MB of tool-call arguments is refused from its size, and one within
  the body bound by the chat's byte limit, before any of it is tokenized;
- INVALID_ARGUMENT answers on gRPC are paced per tenant, as HTTP's 4xx are;
- thousands of idle connections from many addresses deny no authenticated HTTP call.
"""

from __future__ import annotations

import contextlib
import io
import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import httpx

from protos.kvfence.v1 import inference_pb2_grpc
from service.admission.request_fields import prompt_token_limit
from service.admission.request_size import JSON_BYTES_PER_TOKEN, request_limit
from service.http.body import MAX_BODY_BYTES
from tests.isolation import test_redteam_neighbours as neighbours
from tests.isolation.test_noisy_neighbour import _judge
from tests.isolation.test_redteam_neighbours import _judge_flood, _url, _victim
from tests.serverutil import ServerHandle
from tests.verify.calls import gen_request
from tests.verify.neighbours import AttackStats, Latency, attack
from tests.verify.recorder import Recorder
from tests.verify.scale import size

# The server, model and victim baseline of ``test_redteam_neighbours`` (one server per module).
loaded = neighbours.loaded
hsrv = neighbours.hsrv
base = neighbours.base

VICTIM_N = size(4, 15)
SETTLE_S = size(0.5, 2.0)
GENERATE = "/kvfence.v1.Inference/Generate"
PACED_PER_S = 50.0  # HttpGuard.paced_per_s and the gRPC refusal pace
PACED_BURST = 100


def _http_addr(handle: ServerHandle) -> tuple[str, int]:
    assert handle.server.http is not None
    return "127.0.0.1", handle.server.http.port


def _post_head(path: str, key: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _read_response(f: io.BufferedReader) -> int | None:
    """The status of one response read off ``f`` (a socket's binary file), its body
    skipped; None when the connection ends first."""
    line = f.readline()
    if not line:
        return None
    status = int(line.split()[1])
    length = 0
    chunked = False
    while True:
        header = f.readline()
        if header in (b"\r\n", b""):
            break
        name, _, value = header.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
        elif name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    if chunked:
        while True:
            n = int(f.readline().strip() or b"0", 16)
            f.read(n + 2)
            if n == 0:
                break
    elif length:
        f.read(length)
    return status


def _zeros_body(total: int) -> bytes:
    """``{"prompt": [0, 0, ...]}`` of exactly ``total`` bytes (``total`` odd or even)."""
    head, tail = b'{"prompt": [', b"0]}"
    pairs = (total - len(head) - len(tail)) // 2
    body = head + b"0," * pairs + tail
    return body + b" " * (total - len(body))


def test_oversized_http_body(hsrv: ServerHandle, base: Latency, record: Recorder) -> None:
    """Bodies of 8 MiB (``{"prompt": [0, 0, ...]}``, the whole-front byte cap) sent back to
    back on ``/v1/completions``: refused from their size before any byte is parsed."""
    key = hsrv.keys["attacker"]
    body = _zeros_body(MAX_BODY_BYTES)
    request = _post_head("/v1/completions", key, len(body)) + body
    slowest = [0.0]

    def work(_: grpc.Channel, stats: AttackStats, stop: threading.Event, i: int) -> None:
        while not stop.is_set():
            start = time.monotonic()
            with socket.create_connection(_http_addr(hsrv), timeout=60) as s:
                with contextlib.suppress(OSError):  # the server may stop reading: refused
                    s.sendall(request)
                try:
                    status = _read_response(s.makefile("rb"))
                except OSError:
                    status = None
            slowest[0] = max(slowest[0], time.monotonic() - start)
            stats.codes["cut off" if status is None else str(status)] += 1
            stats.calls += 1

    with attack(hsrv.target, work, size(1, 2), SETTLE_S) as stats:
        under = _victim(hsrv).run(VICTIM_N)
    record.info("body bytes", len(body))
    record.info("attacker's slowest answer (s)", round(slowest[0], 3))
    parsed = stats.calls - stats.codes["413"] - stats.codes["cut off"]
    ok = record("8 MiB bodies answered other than 413 (parsed)", parsed, "== 0", parsed == 0)
    _judge_flood(record, base, under, stats)
    assert ok


def test_pipelined_wrong_key_posts(hsrv: ServerHandle, base: Latency, record: Recorder) -> None:
    """Four keep-alive connections pipelining wrong-key POSTs, eight at a time: the first
    401 closes the connection, so nothing pipelined behind it is read or parsed."""
    body = json.dumps({"prompt": "x" * 4000, "max_tokens": 8}).encode()
    one = _post_head("/v1/completions", "kvf_guessed", len(body)) + body
    batch = one * 8
    most = [0]

    def work(_: grpc.Channel, stats: AttackStats, stop: threading.Event, i: int) -> None:
        while not stop.is_set():
            with socket.create_connection(_http_addr(hsrv), timeout=60) as s:
                reader = s.makefile("rb")
                answered = 0
                while not stop.is_set():
                    try:
                        s.sendall(batch)
                        for _ in range(8):
                            status = _read_response(reader)
                            if status is None:
                                break
                            answered += 1
                            stats.codes[str(status)] += 1
                            stats.calls += 1
                        else:
                            continue
                    except OSError:
                        pass
                    break  # the server closed the connection
                most[0] = max(most[0], answered)

    with attack(hsrv.target, work, 4, SETTLE_S) as stats:
        under = _victim(hsrv).run(VICTIM_N)
    record.info("wrong-key answers per second", round(stats.calls / stats.seconds, 1))
    ok = record("most wrong-key answers on one connection", most[0], "== 1", most[0] == 1)
    _judge_flood(record, base, under, stats)
    assert ok


def _bias_payload(entries: int) -> bytes:
    req = gen_request(text="x", max_tokens=1)
    req.sampling.logit_bias.update({i: 1.0 for i in range(entries)})
    return req.SerializeToString()


def test_huge_logit_bias(hsrv: ServerHandle, base: Latency, record: Recorder) -> None:
    """Four threads sending Generate calls whose ``logit_bias`` has 700k entries (7.7 MB),
    pre-serialized so the client spends nothing per call."""
    payload = _bias_payload(700_000)
    auth = hsrv.auth("attacker")
    details: set[str] = set()

    def call(channel: grpc.Channel) -> tuple[grpc.StatusCode, str]:
        generate = channel.unary_stream(
            GENERATE, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        try:
            list(generate(payload, metadata=auth, timeout=60))
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as err:
            return err.code(), err.details() or ""

    with hsrv.channel() as channel:
        start = time.monotonic()
        alone_code, alone_details = call(channel)
        alone = time.monotonic() - start

    def work(channel: grpc.Channel, stats: AttackStats, stop: threading.Event, i: int) -> None:
        while not stop.is_set():
            code, text = call(channel)
            details.add(text)
            stats.count(code)

    with attack(hsrv.target, work, 4, SETTLE_S) as stats:
        under = _victim(hsrv).run(VICTIM_N)
    record.info("request bytes", len(payload))
    record.info("refusal details", alone_details)
    ok = record("status of one call", alone_code.name, "INVALID_ARGUMENT",
                alone_code == grpc.StatusCode.INVALID_ARGUMENT)
    # Receiving 7.7 MB over loopback takes a few ms; parsing and sorting the entries took
    # about a second on 2 cores.
    ok &= record("one refusal on a quiet server (s)", round(alone, 3), "< 0.15", alone < 0.15)
    _judge_flood(record, base, under, stats)
    assert ok


def _tool_history_body(model: str, arguments: int) -> bytes:
    """A chat whose assistant message carries one tool call of ``arguments`` bytes."""
    return json.dumps({
        "model": model, "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "look it up"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "lookup", "arguments": '{"q": "' + "x" * arguments + '"}'},
            }]},
            {"role": "tool", "tool_call_id": "call_1", "content": "none"},
        ],
    }).encode()  # fmt: skip


def test_huge_tool_call_arguments(hsrv: ServerHandle, base: Latency, record: Recorder) -> None:
    """Two threads posting chats whose history holds one tool call's arguments: 7 MB (past
    the body bound, refused from its size) and, taking turns, the largest body the bound
    lets through (refused by the chat's byte limit, which counts tool calls, before any of it
    is tokenized)."""
    key = hsrv.keys["attacker"]
    model = str(hsrv.stack.model.name)
    tokens = prompt_token_limit(hsrv.server.prep.model, 0)
    # Just under the body bound; far over the chat's tokens x 8 bytes.
    within = request_limit(tokens, JSON_BYTES_PER_TOKEN, MAX_BODY_BYTES) - 1024
    bodies = [_tool_history_body(model, 7_000_000), _tool_history_body(model, within)]
    url = _url(hsrv, "/v1/chat/completions")
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    slowest = [0.0, 0.0]
    params: set[str] = set()

    def work(_: grpc.Channel, stats: AttackStats, stop: threading.Event, i: int) -> None:
        with httpx.Client(timeout=60) as client:
            n = 0
            while not stop.is_set():
                which = (i + n) % 2
                n += 1
                start = time.monotonic()
                try:
                    r = client.post(url, content=bodies[which], headers=headers)
                except httpx.HTTPError:
                    stats.codes["cut off"] += 1
                    stats.calls += 1
                    continue
                slowest[which] = max(slowest[which], time.monotonic() - start)
                stats.codes[f"{r.status_code}"] += 1
                stats.calls += 1
                if r.status_code == 400:
                    params.add(str(r.json()["error"].get("param")))

    with attack(hsrv.target, work, 2, SETTLE_S) as stats:
        under = _victim(hsrv).run(VICTIM_N)
    record.info("body bytes (over the bound / within it)", f"{len(bodies[0])} / {len(bodies[1])}")
    record.info("refused fields", sorted(params))
    record.info("attacker's slowest answer (s), over / within", f"{slowest[0]:.3f} / {slowest[1]:.3f}")
    served = stats.calls - stats.codes["413"] - stats.codes["400"] - stats.codes["cut off"]
    ok = record("tool-call histories answered other than 413 / 400", served, "== 0", served == 0)
    ok &= record("the 400s name the call's arguments", sorted(params),
                 "messages[1].tool_calls[0].function.arguments",
                 params == {"messages[1].tool_calls[0].function.arguments"})
    # Tokenizing 7 MB of arguments took 31.6 s; refused on its size it takes milliseconds.
    ok &= record("attacker's slowest refusal (s)", round(max(slowest), 3), "< 1.0",
                 max(slowest) < 1.0)
    _judge_flood(record, base, under, stats)
    assert ok


def test_invalid_grpc_calls_flood(hsrv: ServerHandle, base: Latency, record: Recorder) -> None:
    """Sixteen threads of Generate calls with temperature -1, each sent as soon as the last
    was refused: the refusals are paced per tenant."""
    auth = hsrv.auth("attacker")
    req = gen_request(text="x", max_tokens=1, temperature=-1.0)

    def work(channel: grpc.Channel, stats: AttackStats, stop: threading.Event, i: int) -> None:
        stub = inference_pb2_grpc.InferenceStub(channel)
        while not stop.is_set():
            try:
                list(stub.Generate(req, metadata=auth, timeout=60))
                stats.count(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                stats.count(err.code())

    with attack(hsrv.target, work, 16, SETTLE_S) as stats:
        under = _victim(hsrv).run(VICTIM_N)
    rate = stats.calls / stats.seconds
    bound = 1.5 * PACED_PER_S + PACED_BURST / stats.seconds
    record.info("attacker calls", stats.calls)
    ok = record("attacker refusals per second", round(rate, 1), f"<= {bound:.1f}", rate <= bound)
    ok &= record("attacker calls not INVALID_ARGUMENT",
                 stats.calls - stats.codes["INVALID_ARGUMENT"], "== 0",
                 stats.calls == stats.codes["INVALID_ARGUMENT"])
    _judge_flood(record, base, under, stats)
    assert ok


class _IdleFlood:
    """``per_address`` idle TCP connections from each of ``addresses`` loopback addresses
    to every target, each reopened (from its address) as soon as the server closes it."""

    def __init__(self, targets: list[tuple[str, int]], addresses: int, per_address: int):
        self._targets = targets
        self.wanted = [(f"127.0.0.{2 + a}", t) for a in range(addresses)
                        for t in targets for _ in range(per_address)]
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self.opened = 0
        self.refused = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, source: str, target: tuple[str, int]) -> None:
        try:
            s = socket.create_connection(target, timeout=5, source_address=(source, 0))
        except OSError:
            self.refused += 1
            return
        s.setblocking(False)
        self._sel.register(s, selectors.EVENT_READ, (source, target))
        self.opened += 1

    def _run(self) -> None:
        for source, target in self.wanted:
            if self._stop.is_set():
                return
            self._open(source, target)
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.05):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if data:
                    continue
                self._sel.unregister(s)
                s.close()
                self._open(*key.data)
            time.sleep(0.01)

    @contextlib.contextmanager
    def running(self, ready: int) -> Iterator[_IdleFlood]:
        self._thread.start()
        deadline = time.monotonic() + 60
        while self.opened < ready and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(30)
            for key in list(self._sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._sel.close()


def _http_victim(hsrv: ServerHandle, source: str, n: int) -> list[int]:
    """``n`` authenticated completions over one keep-alive client bound to ``source``."""
    codes: list[int] = []
    headers = {"Authorization": f"Bearer {hsrv.keys['victim']}"}
    body = {"prompt": "Hello", "max_tokens": 2}
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=30) as client:
        for _ in range(n):
            try:
                codes.append(client.post(_url(hsrv, "/v1/completions"), json=body,
                                         headers=headers).status_code)
            except httpx.HTTPError:
                codes.append(0)
            time.sleep(0.05)
    return codes


def test_idle_connection_flood(hsrv: ServerHandle, base: Latency, record: Recorder) -> None:
    """Idle connections from many loopback addresses to both ports, reopened as they close,
    while the victim calls the HTTP front from a fresh address and from one of the flood's
    (a proxy in front of the server gives every client one address)."""
    addresses, per_address = size(24, 64), size(50, 62)
    http_target = _http_addr(hsrv)
    grpc_target = ("127.0.0.1", hsrv.port)
    flood = _IdleFlood([http_target], addresses, per_address)
    grpc_flood = _IdleFlood([grpc_target], size(4, 16), 50)
    n = size(8, 16)
    with flood.running(addresses * per_address), grpc_flood.running(len(grpc_flood.wanted)):
        record.info("idle HTTP connections opened", flood.opened)
        record.info("idle gRPC connections opened", grpc_flood.opened)
        fresh: list[int] = []
        shared: list[int] = []
        t1 = threading.Thread(target=lambda: fresh.extend(_http_victim(hsrv, "127.0.0.250", n)))
        t2 = threading.Thread(target=lambda: shared.extend(_http_victim(hsrv, "127.0.0.2", n)))
        t1.start()
        t2.start()
        under = _victim(hsrv).run(VICTIM_N)
        t1.join(120)
        t2.join(120)
    ok_fresh = sum(c == 200 for c in fresh)
    ok_shared = sum(c == 200 for c in shared)
    record.info("victim HTTP status codes", f"fresh {sorted(set(fresh))}, shared {sorted(set(shared))}")
    ok = record("victim HTTP calls answered 200 (fresh address)", f"{ok_fresh}/{n}",
                f"{n}/{n}", ok_fresh == n)
    ok &= record("victim HTTP calls answered 200 (the flood's address)", f"{ok_shared}/{n}",
                 f"{n}/{n}", ok_shared == n)
    _judge(record, base, under, None)
    assert ok
