"""oomless's files on disk (CPU swap, optimizer state off the device) do not outlive their process:
removed at exit when the user never calls `oomless.remove`, and, after a process killed outright,
by the next process that makes such files in the same place."""

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from oomless.runtime import tiers

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork and the pid check are Linux's here")

# Trains one step with every block swapped to disk and Adam's state in mapped files, prints the
# temporary directory's entries during the step, and either exits (never calling oomless.remove)
# or, with "wait", stays alive until killed.
CHILD = textwrap.dedent("""
    import json, os, sys, tempfile
    import torch
    from torch import nn
    import oomless

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(4)])
    inputs = torch.randn(64, 512)
    optimizer = torch.optim.Adam(model.parameters())
    loss_fn = lambda out: out.square().mean()
    names = oomless.plan(model, inputs, "1GiB", loss_fn=loss_fn, optimizer=optimizer).decisions
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=loss_fn, optimizer=optimizer,
                        decisions={name: "swap" for name in names}, offload_optimizer_state=True)
    oomless.apply(model, plan, optimizer=optimizer)
    for _ in range(2):
        optimizer.zero_grad()
        loss_fn(model(inputs)).backward()
        optimizer.step()
    print(json.dumps(sorted(os.listdir(tempfile.gettempdir()))), flush=True)
    if sys.argv[1:] == ["wait"]:
        sys.stdin.read()
""")


def _child(tmp_path, *arguments) -> subprocess.Popen:
    environment = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.Popen([sys.executable, "-c", CHILD, *arguments], env=environment, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _ours(names: list[str]) -> list[str]:
    return [name for name in names if name.startswith(("oomless-swap-", "oomless-static-"))]


def test_a_process_that_never_calls_remove_leaves_no_files_behind(tmp_path):
    child = _child(tmp_path)
    out, _ = child.communicate(timeout=300)
    assert child.returncode == 0
    during = _ours(json.loads(out.splitlines()[-1]))
    # Both stores existed while it trained, each named for this host and the child's pid.
    assert any(name.startswith(f"oomless-swap-{tiers._host_tag()}-{child.pid}-") for name in during), during
    assert any(name.startswith(f"oomless-static-{tiers._host_tag()}-{child.pid}-") for name in during), during
    assert _ours(os.listdir(tmp_path)) == []


def test_the_next_process_removes_what_a_killed_one_left_and_nothing_of_the_living(tmp_path):
    killed = _child(tmp_path, "wait")
    left = _ours(json.loads(killed.stdout.readline()))
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert len(left) == 2 and sorted(_ours(os.listdir(tmp_path))) == sorted(left)
    # Directories the sweep must keep: a living process's (this one's parent) and another host's.
    living = tmp_path / f"oomless-swap-{tiers._host_tag()}-{os.getppid()}-abcdefgh"
    elsewhere = tmp_path / f"oomless-swap-otherhost-{killed.pid}-abcdefgh"
    for kept in (living, elsewhere):
        kept.mkdir()
        (kept / "0.bin").write_bytes(b"x")

    tiers._sweep_left_behind.cache_clear()
    tier = tiers.DiskTier(str(tmp_path))
    try:
        now = set(os.listdir(tmp_path))
        assert not now & set(left)
        assert {living.name, elsewhere.name, os.path.basename(tier.directory)} <= now
    finally:
        tier.close()
        tiers._sweep_left_behind.cache_clear()
    assert not os.path.exists(tier.directory)


def test_a_forked_child_never_removes_its_parents_files(tmp_path):
    tier = tiers.DiskTier(str(tmp_path))
    ticket = tier.put(torch.arange(256, dtype=torch.uint8))
    tier.wait_out(ticket)
    pid = os.fork()
    if pid == 0:    # the child: what it inherited is closed and collected, as a DataLoader worker's may be
        try:
            tier._remove_directory()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    try:
        assert torch.equal(tier.get(ticket), torch.arange(256, dtype=torch.uint8))
    finally:
        tier.close()
    assert not os.path.exists(tier.directory)


def test_a_store_garbage_collected_removes_its_directory(tmp_path):
    files = tiers.MappedFiles(str(tmp_path))
    files.create(torch.zeros(4096, dtype=torch.uint8))
    directory = files.directory
    assert os.listdir(directory)
    del files
    gc.collect()
    assert not os.path.exists(directory)
