"""Models: shapes forward and backward, blocks where the planner looks for them, tied weights, causality."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from oomless.errors import InputError, OomlessError
from oomless.models import (
    MLP, MODEL_NAMES, DictOutputModel, SmallCNN, TinyTransformer, UNet3D, build_model, example_input_for,
)


def _backward_reaches_every_parameter(model: nn.Module, output: torch.Tensor) -> None:
    output.float().pow(2).mean().backward()
    missing = [name for name, parameter in model.named_parameters() if parameter.grad is None]
    assert not missing, f"no gradient for {missing}"
    assert all(torch.isfinite(parameter.grad).all() for parameter in model.parameters())


@pytest.mark.parametrize("depth, side", [(3, 16), (2, 12), (1, 6)])
def test_unet3d_shapes_and_gradients(depth, side):
    torch.manual_seed(0)
    model = UNet3D(in_channels=2, out_channels=3, base_channels=4, depth=depth)
    logits = model(torch.randn(2, 2, side, side * 2, side))
    assert logits.shape == (2, 3, side, side * 2, side)
    _backward_reaches_every_parameter(model, logits)


def test_unet3d_stages_are_modulelist_items():
    model = UNet3D(depth=3)
    assert isinstance(model.encoders, nn.ModuleList) and len(model.encoders) == 4   # 3 levels + bottleneck
    assert isinstance(model.decoders, nn.ModuleList) and len(model.decoders) == 3
    convs = [m for m in model.encoders[0].modules() if isinstance(m, nn.Conv3d)]
    norms = [m for m in model.encoders[0].modules() if isinstance(m, nn.BatchNorm3d)]
    assert len(convs) == 2 and len(norms) == 2


def test_unet3d_rejects_sizes_not_divisible_by_two_to_the_depth():
    with pytest.raises(InputError, match="divisible by 8"):
        UNet3D(depth=3)(torch.randn(1, 1, 12, 16, 16))


def test_transformer_head_is_tied_to_token_embedding():
    model = TinyTransformer(vocab_size=32, dim=16, depth=2, heads=2, max_len=8)
    assert model.head.weight is model.token_embedding.weight
    names = [name for name, _ in model.named_parameters()]
    assert "head.weight" not in names            # one Parameter, listed once
    logits = model(torch.randint(0, 32, (2, 8)))
    assert logits.shape == (2, 8, 32)
    _backward_reaches_every_parameter(model, logits)


def test_transformer_tied_gradient_sums_both_uses():
    torch.manual_seed(0)
    tied = TinyTransformer(vocab_size=32, dim=16, depth=1, heads=2, max_len=8, dropout=0.0)
    untied = TinyTransformer(vocab_size=32, dim=16, depth=1, heads=2, max_len=8, dropout=0.0)
    untied.load_state_dict(tied.state_dict())
    untied.head.weight = nn.Parameter(tied.token_embedding.weight.detach().clone())
    tokens = torch.randint(0, 32, (2, 8))
    tied(tokens).sum().backward()
    untied(tokens).sum().backward()
    expected = untied.head.weight.grad + untied.token_embedding.weight.grad
    torch.testing.assert_close(tied.token_embedding.weight.grad, expected)


def test_transformer_is_causal_and_backward_works_with_dropout():
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=32, dim=16, depth=2, heads=4, max_len=16, dropout=0.2).eval()
    tokens = torch.randint(0, 32, (1, 10))
    changed = tokens.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 32
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :7], after[:, :7])
    assert not torch.equal(before[:, 7:], after[:, 7:])
    model.train()
    _backward_reaches_every_parameter(model, model(tokens))     # the in-place residual adds are legal


def test_small_models():
    assert MLP(sizes=(5, 7, 3))(torch.randn(4, 5)).shape == (4, 3)
    assert [type(layer) for layer in MLP(sizes=(5, 7, 3))] == [nn.Linear, nn.ReLU, nn.Linear]
    cnn = SmallCNN(in_channels=3, num_classes=5, channels=(8, 8))
    assert isinstance(cnn.blocks, nn.ModuleList) and len(cnn.blocks) == 2
    logits = cnn(torch.randn(2, 3, 16, 16))
    assert logits.shape == (2, 5)
    _backward_reaches_every_parameter(cnn, logits)
    output = DictOutputModel(in_features=6)(torch.randn(3, 6))
    assert set(output) == {"logits", "aux"} and output["logits"].shape == (3, 4) and output["aux"].shape == (3,)


@pytest.mark.parametrize("name", [name for name in MODEL_NAMES if name not in ("monai-unet", "deeplabv3")])
def test_registry_builds_every_model_with_a_matching_example(name):
    torch.manual_seed(0)
    model = build_model(name)
    example = example_input_for(name, batch=2, size=16)
    assert torch.equal(example, example_input_for(name, batch=2, size=16))    # deterministic
    output = model(example)
    logits = output["logits"] if isinstance(output, dict) else output
    assert logits.shape[0] == 2


def test_registry_factory_strings_and_errors():
    model = build_model("oomless.models.mlp:MLP", sizes=(3, 2))
    assert isinstance(model, MLP) and model.sizes == (3, 2)
    with pytest.raises(OomlessError, match="unknown model 'nope'"):
        build_model("nope")
    with pytest.raises(OomlessError, match="cannot import"):
        build_model("no_such_package_xyz:make")
    with pytest.raises(OomlessError, match="no attribute"):
        build_model("oomless.models.mlp:Missing")
    with pytest.raises(InputError, match="rejected its arguments"):
        build_model("unet3d", widht=3)
    with pytest.raises(InputError, match="give its shape"):
        example_input_for("oomless.models.mlp:MLP")
    assert example_input_for("oomless.models.mlp:MLP", shape=(4, 3)).shape == (4, 3)


def test_monai_unet_needs_monai_or_builds():
    try:
        import monai  # noqa: F401
    except ImportError:
        with pytest.raises(OomlessError, match=r"pip install oomless\[monai\]"):
            build_model("monai-unet")
        return
    model = build_model("monai-unet", base_channels=4, depth=2)
    assert model(example_input_for("monai-unet", batch=1, size=8)).shape == (1, 2, 8, 8, 8)


def test_deeplabv3_needs_torchvision_or_builds():
    try:
        import torchvision  # noqa: F401     (importable here through tests/conftest.py, if installed)
    except ImportError:
        with pytest.raises(OomlessError, match=r"pip install oomless\[vision\]"):
            build_model("deeplabv3")
        return
    with pytest.raises(InputError, match="no backbone 'resnet18'"):
        build_model("deeplabv3", backbone="resnet18")
    torch.manual_seed(0)
    model = build_model("deeplabv3", num_classes=3, backbone="mobilenet_v3_large")
    images = example_input_for("deeplabv3", batch=2, size=32)
    output = model(images)
    assert set(output) == {"out"} and output["out"].shape == (2, 3, 32, 32)
    _backward_reaches_every_parameter(model, output["out"])


# A stand-in for torchvision where its C++ extension does not load: a file that is no library, and the
# fake-kernel registration for an op only that extension defines, which torchvision's import makes.
_BROKEN_TORCHVISION = """import torch
from torch.library import register_fake

@register_fake("torchvision::nms")
def _nms(dets, scores, iou_threshold):
    return dets.new_empty(0, dtype=torch.long)
"""

_IMPORT_IT = """import sys
import torch
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "made-importable":
    import oomless                          # calls make_torchvision_importable (oomless/__init__.py)
    from oomless.models import vision
    assert vision._standin_library is not None and not vision.make_torchvision_importable()   # once only
try:
    import torchvision
except RuntimeError as error:
    print("import failed:", error)
    sys.exit(0)
try:
    torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
except NotImplementedError as error:      # defined, with no kernel: calling it says so
    print("imported; nms raises", type(error).__name__)
"""


def test_torchvision_whose_extension_does_not_load_is_made_importable(tmp_path):
    """src/oomless/models/vision.py: torchvision's import registers a fake kernel for an op its C++
    extension defines, and fails where that extension does not load (pytorch/vision#9085);
    make_torchvision_importable defines the op first, without a kernel. In a child process: the
    definitions last as long as the process."""
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text(_BROKEN_TORCHVISION)
    (package / "_C.so").write_bytes(b"not a shared library")
    source = str(Path(__file__).resolve().parents[1] / "src")
    outputs = {}
    for mode in ("plain", "made-importable"):
        completed = subprocess.run([sys.executable, "-c", _IMPORT_IT, str(tmp_path), mode], capture_output=True,
                                   text=True, timeout=120, env={"PYTHONPATH": source, "PATH": "/usr/bin:/bin"})
        assert completed.returncode == 0, completed.stderr[-2000:]
        outputs[mode] = completed.stdout.strip()
    assert outputs["plain"] == "import failed: operator torchvision::nms does not exist"
    assert outputs["made-importable"] == "imported; nms raises NotImplementedError"


@pytest.mark.parametrize("name", ["_C", "_C_stable"])
def test_a_torchvision_extension_that_loads_is_left_alone(tmp_path, name):
    """torchvision 0.29 ships its extension as ``_C_stable`` (torch's stable ABI), earlier releases as
    ``_C``: either one that loads means torchvision defines its ops itself, and defining them first
    would make its import fail on a duplicate registration."""
    import _ctypes
    import importlib.machinery
    import shutil

    from oomless.models import vision

    package = tmp_path / "torchvision"
    package.mkdir()
    assert not vision._extension_loads(package)       # no extension at all
    # Any shared library that loads stands for the extension (torch.ops.load_library only dlopens it).
    shutil.copy(_ctypes.__file__, package / f"{name}{importlib.machinery.EXTENSION_SUFFIXES[0]}")
    assert vision._extension_loads(package)
