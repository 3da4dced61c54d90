"""Models by name: the embedded defaults, small test models, MONAI's UNet, torchvision's DeepLabv3,
or any ``module:factory``.

    from oomless.models import build_model, example_input_for
    model = build_model("unet3d", base_channels=8, depth=3)
    volume = example_input_for("unet3d", batch=2, size=64)          # (2, 1, 64, 64, 64)
    custom = build_model("my_package.nets:make_net", width=128)     # imports and calls make_net(width=128)

A ``module:factory`` is imported as ``python -m`` would: from the installed packages, else from the
current directory (``oomless plan mymodels:make`` finds ./mymodels.py without PYTHONPATH=.).
"""

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn

from oomless.errors import InputError, OomlessError, one_line
from oomless.models.cnn import SmallCNN
from oomless.models.mlp import MLP, DictOutputModel
from oomless.models.transformer import TinyTransformer
from oomless.models.unet3d import UNet3D
from oomless.models.vision import build_deeplabv3, make_torchvision_importable

__all__ = [
    "MODEL_NAMES", "MLP", "DictOutputModel", "SmallCNN", "TinyTransformer", "UNet3D",
    "build_deeplabv3", "build_model", "example_input_for", "make_torchvision_importable", "model_defaults",
]


def build_monai_unet(in_channels: int = 1, out_channels: int = 2, base_channels: int = 16, depth: int = 3,
                     num_res_units: int = 2, **kwargs) -> nn.Module:
    """MONAI's 3D ``UNet`` with channels doubling per level; spatial sizes must divide by ``2**depth``."""
    try:
        from monai.networks.nets import UNet
    except ImportError as error:
        raise OomlessError(
            "model 'monai-unet' needs MONAI, which is not installed; run: pip install oomless[monai]"
        ) from error
    unknown = sorted(set(kwargs) - (set(inspect.signature(UNet).parameters) - {"spatial_dims", "channels", "strides"}))
    if unknown:
        raise InputError(f"model 'monai-unet' rejected its arguments {unknown}: it takes in_channels, out_channels, "
                         "base_channels, depth, num_res_units and MONAI UNet's kernel_size, up_kernel_size, act, "
                         "norm, dropout, bias, adn_ordering")
    return UNet(
        spatial_dims=3, in_channels=in_channels, out_channels=out_channels,
        channels=tuple(base_channels * 2**level for level in range(depth + 1)),
        strides=(2,) * depth, num_res_units=num_res_units, **kwargs,
    )


def build_transformers_model(model_type: str, **config) -> nn.Module:
    """A Hugging Face transformers causal LM built from its config class (``hf:gpt2``, ``hf:llama``),
    randomly initialised: no weights are downloaded. ``config`` sets config fields (n_layer=...)."""
    make_torchvision_importable()       # transformers imports torchvision where it is installed
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as error:
        raise OomlessError(f"model 'hf:{model_type}' needs transformers, which is not installed; "
                           "run: pip install oomless[transformers]") from error
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        # transformers' own message lists all ~800 model types in one line: name the closest few.
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=5, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else "; e.g. hf:gpt2, hf:llama, hf:mistral"
        raise InputError(f"transformers has no model type {model_type!r}{hint}")
    try:
        settings = AutoConfig.for_model(model_type, **config)
    except (ValueError, TypeError) as error:       # a config field it rejects
        raise InputError(f"transformers cannot build hf:{model_type} with {sorted(config)}: "
                         f"{one_line(error)}") from error
    # AutoConfig keeps any key it does not know as a field of its own: a misspelt one (n_layerz)
    # built the default model unsaid. Keys it takes under another name (attn_implementation) are not
    # new fields.
    defaults = CONFIG_MAPPING[model_type]()
    fields = sorted(key for key in {*defaults.to_dict(), *getattr(defaults, "attribute_map", {})}
                    if not key.startswith("_"))
    unknown = [key for key in config if key in settings.to_dict() and key not in fields]
    if unknown:
        close = {key: difflib.get_close_matches(key, fields, n=1, cutoff=0.6) for key in unknown}
        hints = "; ".join(f"{key!r}: did you mean {close[key][0]!r}?" for key in unknown if close[key])
        raise InputError(f"hf:{model_type}'s config has no field {', '.join(map(repr, unknown))}"
                         f"{' (' + hints + ')' if hints else ''}; its fields include "
                         f"{', '.join(fields[:12])}{', ...' if len(fields) > 12 else ''}")
    try:
        return AutoModelForCausalLM.from_config(settings)
    except (ValueError, TypeError) as error:       # a config field it rejects, or no causal-LM head
        raise InputError(f"transformers cannot build hf:{model_type} as a causal LM with {sorted(config)}: "
                         f"{one_line(error)}") from error


_FACTORIES: dict[str, Callable[..., nn.Module]] = {
    "unet3d": UNet3D,
    "transformer": TinyTransformer,
    "mlp": MLP,
    "cnn": SmallCNN,
    "dict-output": DictOutputModel,
    "monai-unet": build_monai_unet,
    "deeplabv3": build_deeplabv3,
}
MODEL_NAMES = tuple(_FACTORIES)


def model_defaults(name: str) -> dict:
    """The keyword arguments a registered model is built with when not given, and their defaults."""
    if name not in _FACTORIES:
        raise InputError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return {key: parameter.default for key, parameter in inspect.signature(_FACTORIES[name]).parameters.items()
            if parameter.default is not inspect.Parameter.empty}


def _import_module(module_name: str):
    """``importlib.import_module``, falling back to the current directory as ``python -m`` has it on
    sys.path first (the ``oomless`` script has its own folder there instead). The directory is only
    added when the module is not found otherwise, and stays, so the module's own imports work."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        top_level = module_name.partition(".")[0]
        here = os.getcwd()
        if error.name != top_level or here in sys.path or "" in sys.path:
            raise
    sys.path.insert(0, here)
    importlib.invalidate_caches()
    return importlib.import_module(module_name)


def _import_factory(spec: str) -> Callable[..., nn.Module]:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise OomlessError(f"model {spec!r} is not 'package.module:factory'")
    try:
        module = _import_module(module_name)
    except ImportError as error:
        raise OomlessError(f"cannot import module {module_name!r} for model {spec!r} (from the installed packages "
                           f"or {os.getcwd()}): {one_line(error)}") from error
    factory = module
    for part in attribute.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise OomlessError(f"module {module_name!r} has no attribute {attribute!r}")
    if not callable(factory):
        raise OomlessError(f"{spec!r} is not callable")
    return factory


def _check_arguments(name: str, factory: Callable, kwargs: dict) -> None:
    # Checked against the signature before the call, so that a TypeError raised inside the factory
    # (a bug there) keeps its traceback while a misspelled or missing argument reads as one line.
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):             # a builtin without a signature: let the call decide
        return
    try:
        signature.bind(**kwargs)
    except TypeError as error:
        accepted = [parameter for parameter in signature.parameters if parameter not in ("self", "args", "kwargs")]
        raise InputError(f"model {name!r} rejected its arguments {sorted(kwargs)}: {error}; it takes "
                         f"{', '.join(accepted) or 'no arguments'} (--model-arg KEY=VALUE)") from None
    for key, value in kwargs.items():
        parameter = signature.parameters.get(key)
        expected = _plain_type(parameter) if parameter is not None else None
        if expected is not None and not _is_a(value, expected) and not (value is None and parameter.default is None):
            raise InputError(f"model {name!r} takes {key} as {expected.__name__}, got {value!r} "
                             f"(--model-arg {key}=VALUE)")


def _plain_type(parameter: inspect.Parameter) -> type | None:
    """int, float, bool or str where the parameter's annotation says so (a default's type alone is
    no promise: ``dropout=0`` takes 0.2)."""
    annotation = parameter.annotation
    if isinstance(annotation, str):             # postponed annotations: the name alone
        annotation = {"int": int, "float": float, "bool": bool, "str": str}.get(annotation)
    return annotation if annotation in (int, float, bool, str) else None


def _is_a(value, expected: type) -> bool:
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def build_model(name: str, **kwargs) -> nn.Module:
    """Build a model from a registered name (see ``MODEL_NAMES``) or a ``package.module:factory`` string."""
    if not isinstance(name, str):
        raise InputError(f"model name must be a string such as 'unet3d' or 'package.module:factory', got "
                         f"{type(name).__name__}")
    if name.startswith("hf:"):
        return build_transformers_model(name[3:], **kwargs)
    if ":" in name:
        factory = _import_factory(name)
        _check_arguments(name, factory, kwargs)
        model = factory(**kwargs)
        if not isinstance(model, nn.Module):
            raise OomlessError(f"factory {name!r} returned {type(model).__name__}, not a torch.nn.Module")
        return model
    if name not in _FACTORIES:
        raise OomlessError(
            f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)} or give 'package.module:factory'"
        )
    _check_arguments(name, _FACTORIES[name], kwargs)
    try:
        return _FACTORIES[name](**kwargs)
    except (ValueError, ZeroDivisionError, RuntimeError, TypeError) as error:
        # One of the project's own models given a value it cannot take (heads=0, dropout=2.0): the
        # value is the user's, the traceback would be ours. A user's factory keeps its traceback.
        raise InputError(f"model {name!r} cannot be built with {kwargs}: {one_line(error)}") from error


def example_input_for(name: str, batch: int = 1, size: int = 32, *, shape: Sequence[int] | None = None,
                      device: torch.device | str | None = None, seed: int = 0, **model_kwargs) -> torch.Tensor:
    """A deterministic example input matching ``build_model(name, **model_kwargs)``.

    ``size`` is the spatial side (volumes, images) or the sequence length (transformer); ``shape``, if
    given, is used as is (its first entry is the batch). Custom ``module:factory`` models need ``shape``.
    """
    generator = torch.Generator().manual_seed(seed)
    if shape is None:
        if name in ("unet3d", "monai-unet"):
            shape = (batch, model_kwargs.get("in_channels", 1), size, size, size)
        elif name in ("cnn", "deeplabv3"):
            shape = (batch, model_kwargs.get("in_channels", 3), size, size)
        elif name == "transformer" or name.startswith("hf:"):
            shape = (batch, size)
        elif name == "mlp":
            shape = (batch, tuple(model_kwargs.get("sizes", MLP().sizes))[0])
        elif name == "dict-output":
            shape = (batch, model_kwargs.get("in_features", 16))
        else:
            raise InputError(f"model {name!r} has no default input; give its shape, e.g. --input-shape 1,3,224,224")
    shape = tuple(int(side) for side in shape)
    if any(side <= 0 for side in shape):
        raise InputError(f"input shape {shape} has a non-positive side")
    if name == "transformer" or name.startswith("hf:"):
        vocab_size = model_kwargs.get("vocab_size", 256)  # hf: token ids below 256 are valid for every vocabulary
        example = torch.randint(0, vocab_size, shape, generator=generator)
    else:
        example = torch.randn(shape, generator=generator)
    return example if device is None else example.to(device)
