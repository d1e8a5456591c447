"""A kvfence cluster on loopback: 3 replicas, Redis and HAProxy, as real processes.

The HAProxy configuration is ``deploy/haproxy/haproxy.cfg`` itself (addresses through its
environment variables), plus a stats socket so the verifier can read server states. A second
HAProxy with ``balance roundrobin`` runs beside it only for contrast in the affinity check.
Everything lives in ``.cluster/`` (state.json, tenants.toml, logs/); processes run in their
own sessions, so ``make cluster`` can return while they keep serving.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from service.admission.tenants import hash_key, new_api_key
from tools.cluster.health import haproxy_servers, replica_serving

ROOT = Path(__file__).resolve().parents[2]
HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
HOST = "127.0.0.1"
# tenant -> (tokens_per_minute, max_concurrent_streams); 0 tpm = unlimited
TENANTS: dict[str, tuple[int, int]] = {
    "alpha": (0, 16),
    "beta": (0, 16),
    "gamma": (0, 16),
    "metered": (3000, 4),
}


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    replicas: int = 3
    lease_ttl_s: float = 3.0
    grace_s: float = 3.0
    kv_memory: str = "48MiB"
    on_redis_failure: str = "open"
    threads_per_replica: int = max(1, (os.cpu_count() or 1) // 3)


@dataclass(slots=True)
class Replica:
    name: str
    port: int
    metrics_port: int
    pid: int = 0

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"


@dataclass(slots=True)
class ClusterState:
    """What ``state.json`` holds: every address, pid and (local, throwaway) API key."""

    workdir: str
    lb_port: int
    rr_port: int
    redis_port: int
    replicas: list[Replica]
    keys: dict[str, str]
    settings: dict[str, object]
    pids: dict[str, int] = field(default_factory=dict)  # redis, haproxy, haproxy_rr

    @property
    def lb(self) -> str:
        return f"{HOST}:{self.lb_port}"

    @property
    def lb_roundrobin(self) -> str:
        return f"{HOST}:{self.rr_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://{HOST}:{self.redis_port}/0"

    @property
    def stats_socket(self) -> str:
        # NOTE: a UNIX socket path must fit in 108 bytes; a CI clone's path may not.
        return str(Path(tempfile.gettempdir()) / f"kvfence-haproxy-{self.lb_port}.sock")

    def save(self) -> None:
        (Path(self.workdir) / "state.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, workdir: Path) -> ClusterState | None:
        path = workdir / "state.json"
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        raw["replicas"] = [Replica(**r) for r in raw["replicas"]]
        return cls(**raw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # A zombie (killed, not yet reaped by its parent) is not alive.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def tool(name: str) -> str | None:
    """The program's path; /usr/sbin is searched too (not on every user's PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")


def missing_tools() -> list[str]:
    return [name for name in ("haproxy", "redis-server") if tool(name) is None]


class LocalCluster:
    """Start, stop and break the processes of one loopback cluster."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.workdir = Path(state.workdir)
        self.logs = self.workdir / "logs"
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    @classmethod
    def create(cls, workdir: Path, settings: ClusterSettings) -> LocalCluster:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "logs").mkdir(exist_ok=True)
        keys = {name: new_api_key() for name in TENANTS}
        lines = []
        for name, (tpm, streams) in TENANTS.items():
            lines += [
                f"[tenants.{name}]",
                f'api_key_sha256 = ["{hash_key(keys[name]).hex()}"]',
                f"tokens_per_minute = {tpm}",
                f"max_concurrent_streams = {streams}",
                "",
            ]
        (workdir / "tenants.toml").write_text("\n".join(lines))
        replicas = [
            Replica(f"replica{i + 1}", free_port(), free_port()) for i in range(settings.replicas)
        ]
        state = ClusterState(
            workdir=str(workdir),
            lb_port=free_port(),
            rr_port=free_port(),
            redis_port=free_port(),
            replicas=replicas,
            keys=keys,
            settings=asdict(settings),
        )
        return cls(state)

    # -- processes ---------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
            start_new_session=True,
        )
        log.close()
        self._children[proc.pid] = proc
        return proc.pid

    def start_redis(self) -> None:
        self.state.pids["redis"] = self._spawn(
            "redis",
            [
                tool("redis-server") or "redis-server", "--port", str(self.state.redis_port), "--bind", HOST,
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
            ],
        )

    def start_replica(self, replica: Replica) -> None:
        s = self.state.settings
        # NOTE: three replicas share this machine's cores; one compute thread each avoids
        # OpenMP threads spinning against each other (which slowed warm-up by 10x and more).
        threads = {"OMP_NUM_THREADS": str(s["threads_per_replica"])}
        replica.pid = self._spawn(
            replica.name,
            [
                sys.executable, "-m", "service.serve.commands", "serve",
                "--host", HOST, "--port", str(replica.port),
                "--metrics-port", str(replica.metrics_port),
                "--tenants", str(self.workdir / "tenants.toml"),
                "--redis-url", self.state.redis_url,
                "--limits-on-redis-failure", str(s["on_redis_failure"]),
                "--stream-lease-ttl", str(s["lease_ttl_s"]),
                "--grace-seconds", str(s["grace_s"]),
                "--kv-memory", str(s["kv_memory"]),
                "--max-num-seqs", "16",
                "--dtype", "float32",  # batch-independent greedy outputs, compared exactly
                "--log-format", "json",
            ],
            threads,
        )

    def _haproxy_config(self, roundrobin: bool) -> Path:
        text = HAPROXY_CFG.read_text()
        text = text.replace(
            "global\n",
            f"global\n    stats socket {self.state.stats_socket}{'-rr' if roundrobin else ''}"
            " mode 600 level admin\n",
            1,
        )
        if roundrobin:
            text = text.replace("balance hdr(authorization)", "balance roundrobin")
            text = "\n".join(
                line for line in text.splitlines() if "hash-type" not in line
                and "hash-balance-factor" not in line
            )
        path = self.workdir / ("haproxy-roundrobin.cfg" if roundrobin else "haproxy.cfg")
        path.write_text(text + "\n")
        return path

    def start_haproxy(self, roundrobin: bool = False) -> None:
        env = {
            "KVFENCE_LB_BIND": f"{HOST}:{self.state.rr_port if roundrobin else self.state.lb_port}"
        }
        for i, replica in enumerate(self.state.replicas):
            env[f"KVFENCE_REPLICA_{i + 1}"] = replica.target
        name = "haproxy_rr" if roundrobin else "haproxy"
        cfg = self._haproxy_config(roundrobin)
        self.state.pids[name] = self._spawn(name, [tool("haproxy") or "haproxy", "-db", "-f", str(cfg)], env)

    def up(self, timeout_s: float = 600.0) -> None:
        self.start_redis()
        for replica in self.state.replicas:
            self.start_replica(replica)
        self.start_haproxy()
        self.start_haproxy(roundrobin=True)
        self.state.save()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for replica in self.state.replicas:
            self.wait_replica(replica, max(1.0, deadline - time.monotonic()))
        self.wait_lb_up(max(1.0, deadline - time.monotonic()))

    def wait_replica(self, replica: Replica, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not replica_serving(replica.target):
            if not alive(replica.pid):
                tail = (self.logs / f"{replica.name}.log").read_text()[-2000:]
                raise RuntimeError(f"{replica.name} exited while starting:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{replica.name} not serving after {timeout_s:.0f} s")
            time.sleep(0.5)

    def wait_lb_up(self, timeout_s: float, names: set[str] | None = None) -> None:
        want = names or {r.name for r in self.state.replicas}
        deadline = time.monotonic() + timeout_s
        while {n for n, st in self.lb_states().items() if st == "UP"} < want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"HAProxy does not see {sorted(want)} UP: {self.lb_states()}")
            time.sleep(0.2)

    def lb_states(self, roundrobin: bool = False) -> dict[str, str]:
        path = self.state.stats_socket + ("-rr" if roundrobin else "")
        return haproxy_servers(path, "kvfence")

    # -- breaking things ---------------------------------------------------------------------

    def signal_replica(self, replica: Replica, sig: signal.Signals) -> None:
        os.kill(replica.pid, sig)

    def wait_exit(self, pid: int, timeout_s: float) -> bool:
        proc = self._children.get(pid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                return True
            if proc is None and not alive(pid):
                return True
            time.sleep(0.05)
        return False

    def stop_redis(self) -> None:
        pid = self.state.pids.get("redis", 0)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
            self.wait_exit(pid, 10)

    def down(self) -> None:
        """Stop every process of the cluster: replicas drain (SIGTERM), then the rest."""
        for replica in self.state.replicas:
            if alive(replica.pid):
                os.kill(replica.pid, signal.SIGTERM)
        for replica in self.state.replicas:
            if not self.wait_exit(replica.pid, 20) and alive(replica.pid):
                os.kill(replica.pid, signal.SIGKILL)
        for name in ("haproxy", "haproxy_rr", "redis"):
            pid = self.state.pids.get(name, 0)
            if alive(pid):
                os.kill(pid, signal.SIGTERM)
                self.wait_exit(pid, 10)
        (self.workdir / "state.json").unlink(missing_ok=True)

    def is_up(self) -> bool:
        pids = [r.pid for r in self.state.replicas] + list(self.state.pids.values())
        return all(alive(pid) for pid in pids)
