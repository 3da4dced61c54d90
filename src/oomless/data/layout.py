"""Where a dataset's files are: a Medical Segmentation Decathlon folder or a folder of pairs.

- Decathlon (``dataset.json`` present): its ``training`` list of {"image", "label"} paths relative to
  the folder, ``modality`` (one entry per image channel) and ``labels`` (class index -> name). The
  Decathlon's tarballs also hold macOS ``._*`` files next to the volumes; listing from dataset.json
  never sees them.
- Pairs: ``NAME_image.nii.gz`` with ``NAME_label.nii.gz`` anywhere under the folder (``.nii`` too).
  Channels and classes then come from the files themselves.

Only paths and declarations are read here; ``oomless.data.prepare`` reads and checks the volumes.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

from oomless.errors import InputError

_PAIR = re.compile(r"^(?P<case>.+)_(?P<kind>image|label)\.nii(\.gz)?$")
_SHOWN = 5          # missing files listed in an error before "and N more"


@dataclass(frozen=True)
class CaseFiles:
    """One training case: its name (unique in the dataset) and the image and label files."""

    name: str
    image: Path
    label: Path


@dataclass(frozen=True)
class DatasetLayout:
    """A dataset's root, cases, and what it declares: modality names (one per channel) and class
    names (index -> name, background included); None where the layout does not declare them."""

    root: Path
    name: str
    cases: tuple[CaseFiles, ...]
    modalities: tuple[str, ...] | None = None
    labels: dict[int, str] | None = None

    def relative(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()


def find_dataset(root: Path | str) -> DatasetLayout:
    """The layout of ``root``; an InputError naming the folder or file when it is not a dataset."""
    root = Path(root)
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "no such folder"
        raise InputError(f"--data {root}: {what}; give a Decathlon task folder (with dataset.json) "
                         f"or a folder of NAME_image.nii.gz / NAME_label.nii.gz pairs")
    if (root / "dataset.json").is_file():
        return _decathlon(root)
    return _pairs(root)


def _decathlon(root: Path) -> DatasetLayout:
    description_path = root / "dataset.json"
    try:
        description = json.loads(description_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"{description_path}: not readable JSON ({error})") from None
    if not isinstance(description, dict) or not isinstance(description.get("training"), list):
        raise InputError(f"{description_path}: has no 'training' list of {{'image': ..., 'label': ...}} entries")
    cases, missing, names = [], [], set()
    for position, entry in enumerate(description["training"]):
        if not isinstance(entry, dict) or not {"image", "label"} <= entry.keys():
            raise InputError(f"{description_path}: training entry {position} is not {{'image': ..., 'label': ...}}: {entry!r}")
        image, label = root / entry["image"], root / entry["label"]
        missing += [path for path in (image, label) if not path.is_file()]
        name = _case_name(image)
        if name in names:
            raise InputError(f"{description_path}: image {entry['image']} is listed twice")
        names.add(name)
        cases.append(CaseFiles(name, image, label))
    if missing:
        shown = ", ".join(str(path) for path in missing[:_SHOWN])
        more = f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
        raise InputError(f"{description_path} lists files that do not exist: {shown}{more}")
    if not cases:
        raise InputError(f"{description_path}: the 'training' list is empty")
    return DatasetLayout(root, str(description.get("name") or root.name), tuple(cases),
                         _modalities(description, description_path), _labels(description, description_path))


def _case_name(image: Path) -> str:
    return image.name.removesuffix(".gz").removesuffix(".nii")


def _modalities(description: dict, path: Path) -> tuple[str, ...] | None:
    modality = description.get("modality")
    if modality is None:
        return None
    if not isinstance(modality, dict) or sorted(modality, key=int) != [str(i) for i in range(len(modality))]:
        raise InputError(f"{path}: 'modality' must map channel indices 0..C-1 to names, got {modality!r}")
    return tuple(str(modality[str(index)]) for index in range(len(modality)))


def _labels(description: dict, path: Path) -> dict[int, str] | None:
    labels = description.get("labels")
    if labels is None:
        return None
    try:
        declared = {int(index): str(name) for index, name in labels.items()}
    except (AttributeError, ValueError):
        raise InputError(f"{path}: 'labels' must map class indices to names, got {labels!r}") from None
    if sorted(declared) != list(range(len(declared))) or len(declared) < 2:
        raise InputError(f"{path}: 'labels' must number the classes 0..N-1 with N >= 2 (0 is background), "
                         f"got indices {sorted(declared)}")
    return declared


def _pairs(root: Path) -> DatasetLayout:
    found: dict[str, dict[str, Path]] = {}
    for path in sorted(root.rglob("*.nii*")):
        match = _PAIR.match(path.name)
        if match is None or path.name.startswith("._"):
            continue
        case = path.parent.relative_to(root).joinpath(match["case"]).as_posix()
        kinds = found.setdefault(case, {})
        if match["kind"] in kinds:
            raise InputError(f"{root}: case {case} has two {match['kind']} files: {kinds[match['kind']]} and {path}")
        kinds[match["kind"]] = path
    if not found:
        raise InputError(f"{root}: neither a dataset.json (Medical Segmentation Decathlon) nor any "
                         f"NAME_image.nii.gz / NAME_label.nii.gz pairs")
    for case, kinds in found.items():
        for kind, other in (("image", "label"), ("label", "image")):
            if kind not in kinds:
                raise InputError(f"{kinds[other]} has no matching {kind} file ({case}_{kind}.nii.gz)")
    cases = tuple(CaseFiles(case, kinds["image"], kinds["label"]) for case, kinds in sorted(found.items()))
    return DatasetLayout(root, root.name, cases)
