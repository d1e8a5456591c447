"""The engine thread is the process's only long-lived thread with an OpenMP pool.

libgomp keeps a pool of workers for every thread that ran a parallel region, until that
thread exits; two live pools on a small machine make every parallel op of a decode step
pay a futex wake-up (service.model.threads). Loading a model, allocating the KV pool, the
warm-up and serving must leave no pool on the caller's thread. Run in a fresh interpreter on
the default model, whose weights and pool are large enough to run in parallel.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, time, torch
from kvcache import CacheConfig
from service.engine.factory import build_engine
from service.engine.types import EngineConfig
from service.model import load_model
from service.model.default import ensure_default_model

def tasks():
    return len(os.listdir("/proc/self/task"))

def settled(limit):
    # An exited thread's pool workers leave a moment after it: wait for them, up to 10 s.
    deadline = time.monotonic() + 10
    while tasks() > limit and time.monotonic() < deadline:
        time.sleep(0.05)
    return tasks()

torch.set_num_threads(2)
path = ensure_default_model()
before = tasks()
loaded = load_model(path, progress=False)
loaded_at = settled(before)
engine = build_engine(loaded, EngineConfig(), CacheConfig(), kv_bytes=64 << 20)
engine.start()
engine.shutdown()
served_at = settled(before)
torch.ones(1 << 22).mul_(2)  # a parallel op on this thread: its pool's workers appear
time.sleep(0.5)  # and stay
print(before, loaded_at, served_at, tasks())
"""


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="OpenMP starts no workers on 1 CPU")
def test_loading_warming_up_and_serving_leave_no_thread_pool_on_the_caller() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    before, loaded_at, served_at, probed = map(int, out.stdout.split()[-4:])
    assert loaded_at == before, "load_model left OpenMP workers on the caller's thread"
    assert served_at == before, "the pool, warm-up or engine left OpenMP workers behind"
    assert probed > before, "the probe cannot see a pool (the checks above prove nothing)"
