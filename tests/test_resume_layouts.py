"""Resuming a run as an uninterrupted one would have gone on: the loop's log means (and so
``--switch-when``) and a relaxed mode's replicas carried through a checkpoint (found by a user-style
crash/resume fuzz). Each test failed before its fix: a resumed run logged the mean of fewer steps
(and switched layout where the uninterrupted run did not); a local-SGD checkpoint resumed under dp,
or a live switch from local SGD to dp, left each rank stepping its own Adam moments with the one
all-reduced gradient, two models where there should be one."""

import torch
from safetensors.torch import load_file

from oomless.train import TrainConfig, train
from oomless.train.checkpoint import list_checkpoints
from tests.parallel_workers import results_of_rank, run_jobs, tiny_config


def _config(**overrides) -> TrainConfig:
    settings = dict(size=16, seed=0, global_batch=2, base_channels=4, depth=2, progress=False, device="cpu",
                    log_every=3)
    settings.update(overrides)
    return TrainConfig(**settings)


def _logged(result) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in result.history}


def test_a_resumed_run_logs_the_means_an_uninterrupted_run_logs(tmp_path):
    whole = _logged(train(_config(steps=9)))
    assert sorted(whole) == [3, 6, 9]
    # Stopped by --steps off the log's period, then given more steps.
    train(_config(steps=4, checkpoint_dir=tmp_path / "stopped"))
    resumed = _logged(train(_config(steps=9, checkpoint_dir=tmp_path / "stopped", resume=True)))
    assert resumed == {6: whole[6], 9: whole[9]}
    # Killed after step 5 (its checkpoint holds steps 4 and 5 of the window): the later files removed.
    train(_config(steps=9, checkpoint_dir=tmp_path / "killed", keep_checkpoints=9))
    for step, path in list_checkpoints(tmp_path / "killed"):
        if step > 5:
            path.unlink()
    resumed = _logged(train(_config(steps=9, checkpoint_dir=tmp_path / "killed", resume=True)))
    assert resumed == {6: whole[6], 9: whole[9]}
    # Another --log-every: its period starts at the resumed step.
    train(_config(steps=4, checkpoint_dir=tmp_path / "relogged"))
    other = _logged(train(_config(steps=7, checkpoint_dir=tmp_path / "relogged", resume=True, log_every=1)))
    assert sorted(other) == [5, 6, 7]


def test_a_local_sgd_run_continued_under_dp_holds_one_model_on_every_rank(tmp_path):
    """Live (--switch-at 4:dp) and through a checkpoint (the same run stopped at step 4, its last step
    off the log period, and resumed): the replicas' mean, Adam's moments included, on both ranks, the
    two ways bit for bit alike, and the same means logged after the switch (the stopped run's sums of
    step 4 end with its layout). A one-process run resumed from a local-SGD checkpoint holds the mean."""
    relaxed = dict(mode="local-sgd", average_every=3)
    switching = dict(parallel=dict(relaxed, switch=[(4, "dp")]), global_batch=4, log_every=3)
    jobs = [("stopped", dict(parallel=relaxed, steps=4, global_batch=4, checkpoint_dir=tmp_path / "ck")),
            ("stopped_too", dict(switching, steps=4, checkpoint_dir=tmp_path / "resumed")),
            ("resumed", dict(switching, steps=7, resume=True, checkpoint_dir=tmp_path / "resumed")),
            ("switched", dict(switching, steps=7)),
            ("average", dict(parallel=relaxed, steps=4, global_batch=4))]
    run_jobs(2, jobs, tmp_path)
    ranks = [results_of_rank(rank, tmp_path) for rank in (0, 1)]
    for name in ("resumed", "switched", "average"):
        assert ranks[0][name]["parameter_digest"] == ranks[1][name]["parameter_digest"], name
    assert ranks[0]["resumed"]["parameter_digest"] == ranks[0]["switched"]["parameter_digest"]
    assert ranks[0]["resumed"]["losses"] == ranks[0]["switched"]["losses"][-2:]      # steps 6 and 7
    # The checkpoint holds two replicas (no average at step 4): their mean is neither.
    (_, path), = list_checkpoints(tmp_path / "ck")[-1:]
    stored = load_file(str(path))
    assert any(not torch.equal(tensor, stored[f"rank.1.{name}"]) for name, tensor in stored.items()
               if name.startswith("model.") and f"rank.1.{name}" in stored)
    one = train(tiny_config(steps=4, global_batch=4, checkpoint_dir=tmp_path / "ck", resume=True,
                            save=tmp_path / "one.safetensors"))
    assert one.steps_done == 4
    saved, average = load_file(str(tmp_path / "one.safetensors")), load_file(str(tmp_path / "average.safetensors"))
    for name, tensor in average.items():
        if tensor.is_floating_point():
            assert torch.equal(saved[name], tensor), name


def test_a_cube_given_as_one_side_or_three_resumes_either_way(tmp_path):
    train(_config(steps=2, checkpoint_dir=tmp_path / "run"))
    resumed = train(_config(steps=3, size=(16, 16, 16), checkpoint_dir=tmp_path / "run", resume=True))
    assert resumed.steps_done == 3


def test_the_checkpointed_log_sums_say_the_period_and_ranks_they_were_summed_under(tmp_path):
    """Each rank's sums are its own shard's: resumed on another number of ranks (or --log-every), the
    run starts its log period afresh rather than mixing them (`_Run.continue_log_window`)."""
    from oomless.train.checkpoint import load_checkpoint

    train(_config(steps=4, checkpoint_dir=tmp_path / "run"))
    (_, path), = list_checkpoints(tmp_path / "run")[-1:]
    window = load_checkpoint(path, train(_config(steps=0)).model).log_window
    assert window["steps"] == 1 and window["world_size"] == 1 and window["log_every"] == 3
