"""What the benchmark programs share: model sizes, the model/input/loss builder, and provenance.

bench_fit.py, bench_predict.py and bench_dp.py import it as ``common``: run as scripts, bench/ is
on sys.path already; loaded from its file path (``oomless bench`` loads bench_fit.py that way), the
program puts bench/ on sys.path first.
"""

import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import oomless
from oomless.errors import InputError
from oomless.models import TinyTransformer, UNet3D

BENCH_DIRECTORY = Path(__file__).resolve().parent
DEFAULT_OUTPUT = Path("runs") / "bench"      # relative to where the program runs, as `make demo`'s runs/

# Sizes: on a 2-core CPU one plain step takes ~0.3-1 s; on an H100 the models are large enough
# that a step's saved activations (GiB) take as long over PCIe as the step's compute.
# "gpt2" (Hugging Face's, needs transformers; `--model gpt2`, not in "all"): on the CPU the model of
# issue 15's table, 6 layers of 256, 8 x 256 tokens, a vocabulary of 2000; on CUDA GPT-2 small.
SIZES = {
    "cpu": {"transformer": dict(dim=256, depth=8, heads=8, vocab_size=512, batch=2, length=256),
            "unet3d": dict(base_channels=8, depth=3, batch=2, side=48),
            "gpt2": dict(dim=256, depth=6, heads=8, vocab_size=2000, batch=8, length=256)},
    "cuda": {"transformer": dict(dim=1024, depth=8, heads=16, vocab_size=8192, batch=4, length=1024),
             "unet3d": dict(base_channels=16, depth=3, batch=2, side=128),
             "gpt2": dict(dim=768, depth=12, heads=12, vocab_size=50257, batch=8, length=1024)},
    "quick": {"transformer": dict(dim=32, depth=2, heads=2, vocab_size=64, batch=2, length=16),
              "unet3d": dict(base_channels=2, depth=2, batch=1, side=8),
              "gpt2": dict(dim=32, depth=2, heads=2, vocab_size=64, batch=2, length=16)},
}


def build_model(name: str, sizes: dict, device: torch.device):
    """The model (on ``device``), its example input and its loss, seeded: the same on every call."""
    torch.manual_seed(0)
    if name == "transformer":
        model = TinyTransformer(vocab_size=sizes["vocab_size"], dim=sizes["dim"], depth=sizes["depth"],
                                heads=sizes["heads"], max_len=sizes["length"], dropout=0.1)
        tokens = torch.randint(0, sizes["vocab_size"], (sizes["batch"], sizes["length"]), device=device)
        targets = tokens.roll(-1, 1)
        return model.to(device), tokens, lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten())
    if name == "unet3d":
        model = UNet3D(base_channels=sizes["base_channels"], depth=sizes["depth"])
        side = sizes["side"]
        volume = torch.randn(sizes["batch"], 1, side, side, side, device=device)
        labels = (volume[:, 0] > 0.5).long()
        return model.to(device), volume, lambda out: F.cross_entropy(out, labels)
    if name == "gpt2":
        from oomless.models import build_model as build_registered

        model = build_registered("hf:gpt2", n_layer=sizes["depth"], n_embd=sizes["dim"], n_head=sizes["heads"],
                                 vocab_size=sizes["vocab_size"], n_positions=sizes["length"])
        tokens = torch.randint(0, sizes["vocab_size"], (sizes["batch"], sizes["length"]), device=device)
        # The next-token loss: each position's logits against the next token.
        return model.to(device), tokens, lambda out: F.cross_entropy(out.logits[:, :-1].flatten(0, 1),
                                                                     tokens[:, 1:].flatten())
    raise InputError(f"unknown benchmark model {name!r}; choose transformer, unet3d, gpt2 or all")


def _git(*arguments: str) -> str | None:
    try:
        return subprocess.run(["git", *arguments], cwd=BENCH_DIRECTORY, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or the CPU model from /proc/cpuinfo (the platform's name without it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            name = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return name


def provenance(device: torch.device | str, command: str | None = None, **extra) -> dict:
    """Where and how a result was produced. ``command`` defaults to this process's command line;
    ``extra`` fields (world_size, backend, ...) are merged in last.

    Several fields appear under two names, ``git_commit``/``commit``, ``git_dirty``/``dirty``,
    ``date_utc``/``utc_date``, ``torch_version``/``torch``: the programs wrote different names before
    they shared this function, and results committed then stay comparable with later ones."""
    device = torch.device(device)
    # A copy of the tree records the commit it was told, OOMLESS_GIT_COMMIT, over its own .git: the
    # GPU machine's copy has none, or one from another moment than its files (seen: the session's
    # first commit under later files). Whether that copy is dirty is then known only where the two agree.
    told, head = os.environ.get("OOMLESS_GIT_COMMIT") or None, _git("rev-parse", "HEAD")
    commit = told or head
    dirty_text = _git("status", "--porcelain", "--untracked-files=no") if commit == head else None
    dirty = None if dirty_text is None else bool(dirty_text)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    record = {
        "device": device.type, "device_name": device_name(device),
        "torch_version": torch.__version__, "torch": torch.__version__,
        "cuda_version": torch.version.cuda if device.type == "cuda" else None,
        "oomless_version": oomless.__version__,
        "git_commit": commit or "unknown", "commit": commit,
        "git_dirty": dirty, "dirty": bool(dirty),
        "date_utc": date, "utc_date": date,
        "command": command if command is not None else shlex.join([sys.executable, *sys.argv]),
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        # Other work on the machine slows multi-threaded CPU kernels (their threads wait on each other).
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "host": socket.gethostname(),
    }
    record.update(extra)
    return record


def result_path(out: Path | str | None, stem: str) -> Path:
    """Where a program writes its JSON, checked before it runs: ``out`` itself when it names a .json
    file, else ``<out>/<stem>-<YYYY-MM-DD>.json`` (UTC date) with ``out`` defaulting to runs/bench/
    under the current directory: never the source tree. Results to commit: ``--out bench/results``."""
    from oomless.output_paths import check_output_path

    if out is not None and Path(out).suffix == ".json":
        return check_output_path(out, "--out")
    folder = check_output_path(DEFAULT_OUTPUT if out is None else out, "--out", directory=True)
    return folder / f"{stem}-{datetime.now(timezone.utc).date().isoformat()}.json"


def write_result(out: Path | str, record: dict) -> Path:
    """Write a benchmark's JSON result (indented, newline-terminated), creating its folder; say where."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")   # whole or not at all: a run stopped mid-write keeps the last
    partial.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(partial, out)
    print(f"wrote {out}")
    return out


class CheckpointedBlock(nn.Module):
    """The baseline PyTorch users write by hand: the block's call goes through torch.utils.checkpoint
    (non-reentrant)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def checkpoint_every_block(model: nn.Module, block_names) -> list[str]:
    """Wrap each named block of ``model`` (qualified names) in `CheckpointedBlock`, in place; deepest
    first, so a block inside another block is wrapped before its parent moves it.

    In-place modules (``ReLU(inplace=True)``) are left as they are: checkpoint saves a block's input
    and an in-place block then overwrites it, which autograd rejects at backward. Unwrapped, they
    cost no memory either: their output is the next checkpointed block's saved input. Returns them."""
    left_plain = []
    for name in sorted(block_names, key=lambda text: text.count("."), reverse=True):
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        block = getattr(parent, child_name)
        if getattr(block, "inplace", False):
            left_plain.append(name)
            continue
        setattr(parent, child_name, CheckpointedBlock(block))
    return left_plain
