"""Probes of the loopback cluster: a replica's gRPC health and HAProxy's view of its servers."""

from __future__ import annotations

import csv
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def replica_serving(target: str, timeout_s: float = 1.0) -> bool:
    """True when ``grpc.health.v1.Health/Check`` answers SERVING."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def haproxy_servers(stats_socket: str, backend: str) -> dict[str, str]:
    """{server name: status} of ``backend`` ("UP", "DOWN", "MAINT", ...); {} when unreachable."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2.0)
            s.connect(stats_socket)
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return {}
    rows = csv.reader(data.decode().lstrip("# ").splitlines())
    header = next(rows, [])
    if "status" not in header:
        return {}
    name_i, server_i, status_i = header.index("pxname"), header.index("svname"), header.index("status")
    return {
        row[server_i]: row[status_i].split()[0]
        for row in rows
        if len(row) > status_i and row[name_i] == backend
        and row[server_i] not in ("BACKEND", "FRONTEND")
    }
