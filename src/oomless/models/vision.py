"""torchvision's models beside any torch build: DeepLabv3 by name, and torchvision importable where
its C++ extension is not.

    from oomless.models import build_model
    model = build_model("deeplabv3", num_classes=2, backbone="resnet50")   # torchvision, no weights

torchvision's wheels for Linux are built against torch's CUDA build. Beside torch's CPU-only build
their C++ extension does not load (it links libc10_cuda), which torchvision means to tolerate: its
detection ops then raise when called. But ``import torchvision`` (0.2x) registers a fake kernel for
two of those ops unconditionally, and fails there because the extension was to define them
(pytorch/vision#9085): so does every library that imports it, transformers' image models included.
`make_torchvision_importable` defines those two ops' schemas, with no kernel, before torchvision is
imported: the import goes on, its models (plain PyTorch) work, and its nms still raises torchvision's
own "Couldn't load custom C++ ops". Nothing is done where the extension loads.
"""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

from oomless.errors import InputError, OomlessError

# The ops `import torchvision` registers fake kernels for without checking that its extension
# loaded (torchvision/_meta_registrations.py), with the schemas its C++ sources give them.
_UNGUARDED_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_standin_library: torch.library.Library | None = None    # kept: its definitions last as long as it does


# torchvision's extension: `_C` up to 0.28, `_C_stable` (built on torch's stable ABI) from 0.29.
_EXTENSION_NAMES = ("_C", "_C_stable")


def _extension_loads(package_directory: Path) -> bool:
    for name in _EXTENSION_NAMES:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = package_directory / f"{name}{suffix}"
            if path.is_file():
                try:
                    torch.ops.load_library(str(path))
                except OSError:
                    return False
                return True
    return False


def make_torchvision_importable() -> bool:
    """Let ``import torchvision`` succeed where its C++ extension does not load beside this torch
    (module docstring). Call it before anything imports torchvision; calling again does nothing.
    Returns whether it had to define the stand-in schemas."""
    global _standin_library
    if _standin_library is not None or "torchvision" in sys.modules:
        return False
    spec = importlib.util.find_spec("torchvision")      # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return False
    if _extension_loads(Path(next(iter(spec.submodule_search_locations)))):
        return False
    _standin_library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _UNGUARDED_SCHEMAS:
        _standin_library.define(schema)
    return True


DEEPLABV3_BACKBONES = ("resnet50", "resnet101", "mobilenet_v3_large")


def build_deeplabv3(num_classes: int = 2, backbone: str = "resnet50", aux_loss: bool = False) -> nn.Module:
    """torchvision's DeepLabv3 for 2D segmentation, randomly initialised (no weights downloaded).
    Its forward returns a dict: ``"out"`` (and ``"aux"`` with ``aux_loss``), logits at the input's size."""
    if backbone not in DEEPLABV3_BACKBONES:
        raise InputError(f"DeepLabv3 has no backbone {backbone!r}; choose {', '.join(DEEPLABV3_BACKBONES)}")
    make_torchvision_importable()
    try:
        from torchvision.models import segmentation
    except ImportError as error:
        raise OomlessError("model 'deeplabv3' needs torchvision, which is not installed; "
                           "run: pip install oomless[vision]") from error
    factory = getattr(segmentation, f"deeplabv3_{backbone}")
    return factory(weights=None, weights_backbone=None, num_classes=num_classes, aux_loss=aux_loss)
