"""``oomless train --data``: the whole path on a tiny NIfTI dataset (stage, load, train, validate,
save), N-class models, loader workers and the stage changing nothing, resume, and Dice as defined."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("nibabel")

from oomless.cli.main import main                                                   # noqa: E402
from oomless.data.config import DataConfig                                          # noqa: E402
from oomless.data.layout import find_dataset                                        # noqa: E402
from oomless.data.make_dataset import write_synthetic_dataset                       # noqa: E402
from oomless.data.nifti import read_nifti                                           # noqa: E402
from oomless.data.prepare import prepare_dataset                                    # noqa: E402
from oomless.data.volumes import VolumeDataset                                      # noqa: E402
from oomless.errors import InputError                                               # noqa: E402
from oomless.train import TrainConfig, train                                        # noqa: E402
from oomless.train.losses import dice_per_class, hard_dice, segmentation_loss       # noqa: E402
from oomless.train.validate import validate_volumes                                 # noqa: E402


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny") / "Task99_Tiny"
    write_synthetic_dataset(directory, cases=5, size=16, channels=2, classes=3, seed=0)
    return directory


def _config(dataset_dir: Path, run_dir: Path, train_settings: dict | None = None, **data_settings) -> TrainConfig:
    data = DataConfig(path=dataset_dir, run_dir=run_dir, **{"workers": 0, **data_settings})
    settings = dict(steps=2, seed=0, global_batch=2, base_channels=4, depth=2, progress=False, device="cpu",
                    log_every=1)
    return TrainConfig(data=data, **{**settings, **(train_settings or {})})


def _assert_state_equal(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    assert not [name for name in first if not torch.equal(first[name], second[name])]


def test_the_whole_path_from_the_command_line(dataset_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["train", "--data", str(dataset_dir), "--stage", str(tmp_path / "stage"), "--run-dir", str(run_dir),
                 "--steps", "2", "--global-batch", "2", "--base-channels", "4", "--depth", "2", "--device", "cpu",
                 "--workers", "2", "--validate-every", "1", "--save", str(tmp_path / "final.safetensors")])
    assert code == 0
    out = capsys.readouterr()
    assert "validation: mean dice" in out.out and "data wait" in out.out
    assert "5 file(s) copied" not in out.err and "11 file(s) copied" in out.err     # dataset.json + 5 pairs
    weights = load_file(str(tmp_path / "final.safetensors"))
    assert weights["encoders.0.0.weight"].shape[1] == 2 and weights["head.weight"].shape[0] == 3
    split = json.loads((run_dir / "split.json").read_text())
    assert len(split["validation"]) == 1 and len(split["train"]) == 4 and split["seed"] == 0
    validations = json.loads((run_dir / "validation.json").read_text())
    assert [record["step"] for record in validations] == [1, 2]
    assert set(validations[-1]["dice"]) == {"lesion type 1", "lesion type 2"}
    assert all(0.0 <= score <= 1.0 for score in validations[-1]["dice"].values())
    held_out = split["validation"][0]
    prediction, affine = read_nifti(run_dir / f"prediction-{held_out}.nii.gz", dtype=None)
    image, image_affine = read_nifti(dataset_dir / "imagesTr" / f"{held_out}.nii.gz")
    assert prediction.shape[1:] == image.shape[1:] and np.array_equal(affine, image_affine)
    assert set(np.unique(prediction).tolist()) <= {0, 1, 2}


def test_workers_and_the_stage_change_nothing_in_the_trained_model(dataset_dir, tmp_path):
    in_process = train(_config(dataset_dir, tmp_path / "a"))
    prefetched = train(_config(dataset_dir, tmp_path / "b", workers=2, stage=tmp_path / "stage"))
    _assert_state_equal(in_process.model.state_dict(), prefetched.model.state_dict())
    assert in_process.validation[-1]["dice"] == prefetched.validation[-1]["dice"]
    assert prefetched.data_wait_seconds > 0 and len(prefetched.history) == 2
    assert len(prefetched.data_wait_seconds_per_step) == 2
    assert prefetched.data_wait_seconds == sum(prefetched.data_wait_seconds_per_step)
    assert all(record["data_wait_seconds"] >= 0 for record in prefetched.history)


def test_training_equals_a_plain_loop_over_the_same_batches(dataset_dir, tmp_path):
    result = train(_config(dataset_dir, tmp_path / "run", validation_fraction=0.4))
    torch.manual_seed(0)
    from oomless.models import UNet3D

    reference = UNet3D(in_channels=2, out_channels=3, base_channels=4, depth=2)
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    prepared = prepare_dataset(find_dataset(dataset_dir))
    held_out = set(json.loads((tmp_path / "run" / "split.json").read_text())["validation"])
    dataset = VolumeDataset([case for case in prepared.cases if case.name not in held_out], (16, 16, 16), 3, seed=0)
    for step in range(2):
        volumes, labels = dataset.batch(step * 2, 2)
        segmentation_loss(reference(volumes), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _assert_state_equal(result.model.state_dict(), reference.state_dict())


def test_resume_continues_the_data_and_the_validation_record(dataset_dir, tmp_path):
    whole = train(_config(dataset_dir, tmp_path / "a", dict(steps=3, checkpoint_dir=tmp_path / "ck-a"), validate_every=1))
    train(_config(dataset_dir, tmp_path / "b", dict(steps=2, checkpoint_dir=tmp_path / "ck-b"), validate_every=1))
    resumed = train(_config(dataset_dir, tmp_path / "b", dict(steps=3, checkpoint_dir=tmp_path / "ck-b", resume=True),
                            validate_every=1))
    _assert_state_equal(whole.model.state_dict(), resumed.model.state_dict())
    assert [record["step"] for record in json.loads((tmp_path / "b" / "validation.json").read_text())] == [1, 2, 3]
    with pytest.raises(InputError, match="another train/validation split"):
        train(_config(dataset_dir, tmp_path / "b", dict(steps=4, checkpoint_dir=tmp_path / "ck-b", resume=True),
                      validation_fraction=0.6))


def test_validation_dice_of_a_perfect_and_an_empty_prediction(dataset_dir):
    prepared = prepare_dataset(find_dataset(dataset_dir))
    dataset = VolumeDataset(prepared.cases[:2], (16, 16, 16), 3, augment=False)

    class Oracle(torch.nn.Module):
        """Returns the one-hot of the case's label (found by its volume), or all background."""

        def __init__(self, perfect: bool):
            super().__init__()
            self.perfect = perfect
            self.cases = [dataset.fitted(index) for index in range(2)]

        def forward(self, volume):
            label = next(label for known, label in self.cases if torch.equal(known, volume[0]))
            if not self.perfect:
                label = torch.zeros_like(label)
            return torch.nn.functional.one_hot(label, 3).permute(3, 0, 1, 2)[None].float()

    names = ("background", "a", "b")
    perfect = validate_volumes(Oracle(True), dataset, torch.device("cpu"), names, step=7)
    assert perfect["mean_dice"] == 1.0 and perfect["step"] == 7 and len(perfect["cases"]) == 2
    empty = validate_volumes(Oracle(False), dataset, torch.device("cpu"), names, step=7)
    labels = [np.asarray(dataset.native(index)[1]) for index in range(2)]
    for name, lesion in (("a", 1), ("b", 2)):
        # 0 for a case holding the class, 1 for a case holding neither prediction nor class.
        expected = np.mean([0.0 if (label == lesion).any() else 1.0 for label in labels])
        assert empty["dice"][name] == expected


def test_multiclass_losses_and_dice_per_class():
    labels = torch.zeros(1, 4, 4, 4, dtype=torch.long)
    labels[0, :2, :2, :2] = 1
    labels[0, 2:, 2:, 2:] = 2
    logits = torch.nn.functional.one_hot(labels, 3).permute(0, 4, 1, 2, 3).float() * 30
    assert segmentation_loss(logits, labels).item() < 1e-3 and hard_dice(logits, labels).item() == 1.0
    predicted = labels.clone()
    predicted[0, 0, 0, :2] = 2        # 2 voxels of class 1 (of 8) called class 2 (which has 8 of its own)
    scores = dice_per_class(predicted, labels, 3)
    assert torch.allclose(scores, torch.tensor([2 * 6 / (6 + 8), 2 * 8 / (10 + 8)]))
    assert dice_per_class(torch.zeros_like(labels), torch.zeros_like(labels), 3).tolist() == [1.0, 1.0]


def test_bad_data_stops_the_command_before_training_with_one_line(dataset_dir, tmp_path, capsys):
    broken = Path(shutil.copytree(dataset_dir, tmp_path / "broken"))
    truncated = broken / "labelsTr" / "case_003.nii.gz"
    truncated.write_bytes(truncated.read_bytes()[:40])
    assert main(["train", "--data", str(broken), "--run-dir", str(tmp_path / "run"), "--device", "cpu", "--quiet"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("oomless train: error: ") and "labelsTr/case_003.nii.gz: cannot read as NIfTI" in error
    assert not (tmp_path / "run").exists()
    assert main(["train", "--data", str(tmp_path / "nowhere"), "--device", "cpu"]) == 2
    assert "no such folder" in capsys.readouterr().err


TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed beside this Python")
def test_data_parallel_on_files_stages_once_and_equals_one_process(dataset_dir, tmp_path):
    # Both ranks are LOCAL_RANK 0 and 1 of one node: rank 0 stages and decodes, rank 1 waits and reuses it.
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "oomless", "train", "--parallel", "dp",
               "--data", str(dataset_dir), "--stage", str(tmp_path / "stage"), "--run-dir", str(tmp_path / "run"),
               "--global-batch", "2", "--steps", "2", "--base-channels", "4", "--depth", "2", "--device", "cpu",
               "--workers", "1", "--validate-every", "1", "--quiet", "--save", str(tmp_path / "dp.safetensors")]
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stderr.count("11 file(s) copied") == 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # as the workers run: CPU kernels' sums depend on the thread split
    try:
        one_process = train(_config(dataset_dir, tmp_path / "one"))
    finally:
        torch.set_num_threads(threads)
    weights = load_file(str(tmp_path / "dp.safetensors"))
    reference = one_process.model.state_dict()
    # Stated tolerance: 2 ranks sum gradients and statistics in another order, and Adam's first steps
    # divide each gradient entry by its own magnitude, so near-zero entries move by a visible share of
    # lr (measured 1.6e-5 here; 3.5e-6 for the synthetic default at these settings). Other data on a
    # rank (a wrong shard or augmentation) moves every weight by ~lr = 1e-3.
    differences = {name: (weights[name].double() - reference[name].double()).abs().max().item() for name in reference}
    assert max(differences.values()) < 1e-4, differences
    validations = json.loads((tmp_path / "run" / "validation.json").read_text())
    assert [record["step"] for record in validations] == [1, 2]


def test_predicted_class_is_argmax_with_ties_and_nan():
    """`predicted_class` (max's indices, 30x faster than argmax on CPU) picks what argmax picks: the
    first of equal logits, and a NaN over any number."""
    from oomless.train.losses import predicted_class

    generator = torch.Generator().manual_seed(0)
    for shape, dim in (((4, 3, 6, 6, 6), 1), ((3, 9, 9, 9), 0)):
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randint(0, 3, shape, generator=generator).to(dtype)    # many ties
            logits.view(-1)[::37] = float("nan")
            assert torch.equal(predicted_class(logits, dim), logits.argmax(dim=dim))
    tied = torch.zeros(1, 3, 2, 2, 2)
    assert predicted_class(tied).eq(0).all()


def test_the_steps_peak_is_read_apart_from_whole_volume_validation(dataset_dir, tmp_path, capsys, monkeypatch):
    """Validation (an eval forward at batch 1, labels read at their grid, a NIfTI written) is not a
    planned step: the plan is compared with the training steps' peak, validation's said apart. Here
    each validation also touches 96 MiB, far above this tiny run's steps: the steps' peak leaves it
    out, the run's peak has it. Validation's own code's start-up runs once before memory is counted,
    on a stand-in network, and is no validation of the run."""
    from oomless.sizes import format_bytes
    from oomless.train import validate

    real = validate.validate_volumes

    def heavy(*args, **kwargs):
        block = torch.ones(96 * 2**20 // 4)
        del block
        return real(*args, **kwargs)

    monkeypatch.setattr(validate, "validate_volumes", heavy)
    result = train(_config(dataset_dir, tmp_path / "run", dict(steps=3, memory="1GiB"), validate_every=1))
    assert [record["step"] for record in result.validation] == [1, 2, 3]
    assert result.peak_memory_bytes - result.steps_peak_memory_bytes > 64 * 2**20
    line = next(text for text in capsys.readouterr().err.splitlines() if text.startswith("predicted vs measured"))
    assert f" vs {format_bytes(result.steps_peak_memory_bytes)} (budget " in line, line
    assert "with whole-volume validation, not a planned step" in line
