"""Every mistake a user can type gets one line saying what was wrong and what works, exit status 2,
no traceback, and nothing written: each CLI flag of ``oomless train|plan|bench`` and each argument
of the public functions, as a table."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import oomless
from oomless.cli.main import attach_negative_values, main
from oomless.models import SmallCNN
from tests.test_cli import SOURCE

CUDA = torch.cuda.is_available()

TRAIN = ["train", "--size", "16", "--depth", "2", "--base-channels", "4", "--steps", "1", "--device", "cpu"]
PLAN = ["plan", "mlp", "--memory", "1GiB"]

# (arguments, a fragment of the one line expected). Files named here: "a-file" exists (a file), and
# nothing else does; each case runs in an empty folder holding only that file.
CLI_CASES = [
    # oomless train
    (["train", "--size", "abc"], "--size 'abc' is not an integer or D,H,W integers"),
    (["train", "--size", "16,16"], "must be one side or three (D,H,W)"),
    (["train", "--size", "20"], "divisible by 2**depth = 8"),
    (["train", "--size", "0"], "must be positive"),
    (TRAIN + ["--memory", "-1GiB"], "memory size must be positive, got '-1GiB'"),
    (TRAIN + ["--memory", "lots"], "memory size 'lots' does not parse"),
    (TRAIN + ["--memory", "0"], "memory size must be positive"),
    (TRAIN + ["--memory", "1e400"], "too large to be a number of bytes"),
    (TRAIN + ["--steps", "-1"], "steps must be at least 0"),
    (TRAIN + ["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    (TRAIN + ["--lr", "0"], "lr must be a positive finite number"),
    (TRAIN + ["--lr", "nan"], "lr must be a positive finite number"),
    (TRAIN + ["--lr", "inf"], "lr must be a positive finite number"),
    (TRAIN + ["--max-grad-norm", "-1"], "max-grad-norm must be a positive finite number"),
    (TRAIN + ["--seed", "-1"], "seed must be between 0 and 2**32 - 1"),
    (TRAIN + ["--seed", str(2**32)], "seed must be between 0 and 2**32 - 1"),
    (TRAIN + ["--device", "foo"], "device 'foo' is not one of auto, cpu, cuda, cuda:N"),
    (TRAIN + ["--device", "mps"], "device 'mps' is not one of auto, cpu, cuda, cuda:N"),
    (TRAIN + ["--device", "cuda:64"], "device 'cuda:64' asked for"),
    (TRAIN + ["--global-batch", "0"], "global-batch must be at least 1"),
    (TRAIN + ["--channels", "0"], "channels must be at least 1"),
    (TRAIN + ["--base-channels", "0"], "base-channels must be at least 1"),
    (TRAIN + ["--depth", "0"], "depth must be at least 1"),
    (TRAIN + ["--checkpoint-every", "0"], "checkpoint-every must be at least 1"),
    (TRAIN + ["--keep-checkpoints", "0"], "keep-checkpoints must be at least 1"),
    (TRAIN + ["--log-every", "0"], "log-every must be at least 1"),
    (TRAIN + ["--resume"], "resume needs a checkpoint directory (--checkpoint-dir)"),
    (TRAIN + ["--checkpoint-dir", "a-file"], "checkpoint-dir a-file is a file; name a directory"),
    (TRAIN + ["--checkpoint-dir", "a-file/ck"], "a-file is a file, not a directory"),
    (TRAIN + ["--save", "."], "save . is a directory; name a file in it"),
    (TRAIN + ["--save", "a-file/w.safetensors"], "a-file is a file, not a directory"),
    # A folder the filesystem refuses whatever the permission bits say (root passed os.access there,
    # trained the whole run and lost its weights in a traceback at the save; as another user,
    # os.access refused it already).
    *([(TRAIN + ["--save", "/proc/w.safetensors"], "/proc is not writable"),
       (TRAIN + ["--checkpoint-dir", "/proc/ck"], "/proc is not writable")] if sys.platform.startswith("linux") else []),
    (TRAIN + ["--model", "resnet"], "invalid choice: 'resnet'"),
    (TRAIN + ["--parallel", "ring"], "invalid choice: 'ring'"),
    (TRAIN + ["--average-every", "0"], "average-every must be at least 1"),
    (TRAIN + ["--bucket-cap-mb", "0"], "bucket-cap-mb must be positive"),
    (TRAIN + ["--timeout", "-1"], "timeout must be positive"),
    (TRAIN + ["--stages", "0"], "stages must be at least 1"),
    (TRAIN + ["--microbatches", "0"], "microbatches must be at least 1"),
    (TRAIN + ["--stages-per-rank", "0"], "must be at least 1"),
    (TRAIN + ["--schedule", "2f2b"], "invalid choice: '2f2b'"),
    (TRAIN + ["--schedule", "zbv"], "--schedule applies under --parallel hybrid or pipeline"),
    (TRAIN + ["--parallel", "dp", "--average-every", "3"], "--average-every applies under --parallel local-sgd"),
    (TRAIN + ["--parallel", "local-sgd", "--no-overlap"], "--no-overlap applies under --parallel dp"),
    (TRAIN + ["--parallel", "dp", "--overlap", "backward", "--no-overlap"], "contradict each other"),
    (TRAIN + ["--microbatches", "2", "--switch-at", "2:dp"], "--microbatches applies under --parallel hybrid or pipeline"),
    (TRAIN + ["--switch-at", "x:dp"], "'x:dp' is not STEP:LAYOUT"),
    (TRAIN + ["--switch-at", "3:ring"], "layout 'ring' is not one of"),
    (TRAIN + ["--switch-at", "3:pipeline:x"], "layout 'pipeline:x' is not one of"),
    (TRAIN + ["--switch-when", "loss<abc:dp"], "switch condition 'loss<abc' is not METRIC<VALUE"),
    (TRAIN + ["--switch-when", "speed<1:dp"], "switch condition 'speed<1' is not METRIC<VALUE"),
    (TRAIN + ["--sise", "16"], "unrecognized arguments: --sise 16"),
    (TRAIN + ["--workers", "3"], "--workers applies with --data DIR"),
    (TRAIN + ["--data", "no-such-folder"], "--data no-such-folder: no such folder"),
    (TRAIN + ["--data", "a-file"], "--data a-file: is a file, not a folder"),
    # oomless make-data
    (["make-data", "a-file"], "DIR a-file is a file; name a directory"),
    (["make-data", "new", "--seed", "-1"], "--seed must be between 0 and 2**32 - 1"),
    (["make-data", "new", "--cases", "0"], "need cases >= 1"),
    # oomless plan
    (["plan", "nope", "--memory", "1GiB"], "unknown model 'nope'; choose one of"),
    (["plan", ":make", "--memory", "1GiB"], "is not 'package.module:factory'"),
    (["plan", "no_such_module_here:make", "--memory", "1GiB"], "cannot import module 'no_such_module_here'"),
    (["plan", "os:nothere", "--memory", "1GiB"], "module 'os' has no attribute 'nothere'"),
    (["plan", "os:getcwd", "--memory", "1GiB"], "returned str, not a torch.nn.Module"),
    (["plan", "torch.nn:Linear", "--memory", "1GiB"], "missing a required argument: 'in_features'"),
    (["plan", "mlp"], "the following arguments are required: --memory"),
    (PLAN[:2] + ["--memory", "-1GiB"], "memory size must be positive, got '-1GiB'"),
    (PLAN[:2] + ["--memory", "20 gigs"], "does not parse"),
    (PLAN + ["--model-arg", "nope=3"], "rejected its arguments ['nope']"),
    (PLAN + ["--model-arg", "depth"], "--model-arg 'depth' is not key=value"),
    (["plan", "unet3d", "--memory", "1GiB", "--input-shape", "2,1,16,16,16", "--model-arg", "depth=abc"],
     "model 'unet3d' takes depth as int, got 'abc'"),
    (["plan", "unet3d", "--memory", "1GiB", "--input-shape", "2,1,16,16,16", "--model-arg", "base_channels=4.5"],
     "model 'unet3d' takes base_channels as int, got 4.5"),
    (["plan", "transformer", "--memory", "1GiB", "--input-shape", "2,16", "--model-arg", "heads=0"],
     "model 'transformer' cannot be built with {'heads': 0}"),
    (["plan", "transformer", "--memory", "1GiB", "--input-shape", "2,16", "--model-arg", "dropout=2.0"],
     "dropout probability has to be between 0 and 1"),
    (["simulate", "transformer", "--input-shape", "2,16", "--global-batch", "4", "--target", "h100", "--gpus", "2",
      "--model-arg", "dim=abc"], "model 'transformer' takes dim as int, got 'abc'"),
    (PLAN + ["--input-shape", "4,x"], "is not comma-separated integers"),
    (PLAN + ["--input-shape", "0,16"], "needs positive sides"),
    (PLAN + ["--input-shape", "2,5"], "model 'mlp' fails on its example input of shape (2, 5)"),
    (["plan", "cnn", "--memory", "1GiB", "--input-shape", "2,3"], "fails on its example input of shape (2, 3)"),
    (["plan", "transformer", "--memory", "1GiB", "--size", "4096"], "exceeds max_len"),
    (PLAN + ["--batch", "0"], "--batch must be positive"),
    (PLAN + ["--size", "-3"], "--size must be positive"),
    (PLAN + ["--blocks", "nothere"], "are not modules of the model"),
    (PLAN + ["--target", "h900"], "unknown target device 'h900'"),
    (PLAN + ["--dtype", "bf16"], "--dtype applies with --target"),
    (PLAN + ["--optimizer", "lion"], "invalid choice: 'lion'"),
    (PLAN + ["--solver", "fast"], "invalid choice: 'fast'"),
    (PLAN + ["--plot", "."], "--plot . is a directory"),
    (PLAN + ["--plot", "a-file/plan.png"], "a-file is a file, not a directory"),
    (PLAN[:2] + ["--memory", "1KiB"], "no plan fits 1.00 KiB: the smallest budget that fits is"),
    # oomless bench
    (["bench", "--device", "foo"], "--device 'foo': the benchmark runs on cpu, cuda or cuda:N"),
    (["bench", "--device", "mps"], "the benchmark runs on cpu or cuda"),
    (["bench", "--steps", "0"], "--steps must be at least 1"),
    (["bench", "--quick", "--device", "cpu", "--warmup", "-1"], "--warmup >= 0"),
    (["bench", "--quick", "--device", "cpu", "--threads", "0"], "--threads must be >= 1"),
    (["bench", "--quick", "--device", "cpu", "--out", "a-file"], "--out a-file is a file; name a directory"),
    (["bench", "--quick", "--device", "cpu", "--out", "a-file/fit.json"], "a-file is a file, not a directory"),
    (["bench", "--model", "resnet"], "invalid choice: 'resnet'"),
    (["nope"], "invalid choice: 'nope'"),
]
if CUDA:
    CLI_CASES = [case for case in CLI_CASES if "cuda:64" not in case[0]]


@pytest.mark.parametrize("arguments, expected", CLI_CASES, ids=[" ".join(case[0]) for case in CLI_CASES])
def test_cli_mistake_gives_one_line_exit_2_and_writes_nothing(arguments, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder\n")
    try:
        status = main(arguments)
    except SystemExit as exited:                 # argparse's own usage errors
        status = exited.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert status == 2, captured.err
    assert len(lines) == 1 and expected in lines[0], captured.err
    assert lines[0].startswith("oomless") and len(lines[0]) < 600
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file"]


def test_negative_values_reach_the_checks_instead_of_reading_as_flags():
    assert attach_negative_values(["train", "--memory", "-1GiB", "--seed", "-1", "--resume"]) == [
        "train", "--memory=-1GiB", "--seed=-1", "--resume"]
    assert attach_negative_values(["plan", "mlp", "--memory=2GiB", "--json"]) == ["plan", "mlp", "--memory=2GiB", "--json"]


def test_unknown_hf_model_type_is_one_short_line(capsys):
    pytest.importorskip("transformers")
    assert main(["plan", "hf:lama", "--memory", "1GiB"]) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert "no model type 'lama'; did you mean llama" in line and len(line) < 300


def test_a_misspelt_hf_config_field_is_refused_naming_the_one_meant(capsys):
    # AutoConfig takes any key: n_layerz built the default 12-layer GPT-2, and its plan refused 512 MiB.
    pytest.importorskip("transformers")
    assert main(["plan", "hf:gpt2", "--input-shape", "2,16", "--memory", "1GiB", "--model-arg", "n_layerz=2"]) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert "hf:gpt2's config has no field 'n_layerz' ('n_layerz': did you mean 'n_layer'?)" in line, line
    # A key the config takes under another name is no misspelling.
    from oomless.models import build_model
    built = build_model("hf:gpt2", attn_implementation="eager", n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    assert built.config._attn_implementation == "eager" and built.config.n_layer == 1


def _model_and_inputs():
    torch.manual_seed(0)
    return SmallCNN(in_channels=3, num_classes=10), torch.randn(2, 3, 8, 8)


def _loss(output):
    return output.sum()


# (call on (model, inputs), the error, a fragment of its message)
API_CASES = {
    "model None": (lambda m, x: oomless.plan(None, x, "1GiB", loss_fn=_loss), oomless.InputError,
                   "takes a torch.nn.Module as its model, got NoneType"),
    "inputs without a tensor": (lambda m, x: oomless.plan(m, ["a"], "1GiB", loss_fn=_loss), oomless.InputError,
                                "example_inputs holds no tensor"),
    "memory -1GiB": (lambda m, x: oomless.plan(m, x, "-1GiB", loss_fn=_loss), oomless.SizeError, "must be positive"),
    # Fractions of a byte were cut to whole ones: "0.5" refused as not positive, 1.5 planned for 1 byte.
    "memory 0.5": (lambda m, x: oomless.plan(m, x, "0.5", loss_fn=_loss), oomless.SizeError,
                   "'0.5' is a fraction of a byte; give whole bytes, or a unit such as '0.5GiB'"),
    "memory 1.5": (lambda m, x: oomless.fit(m, x, 1.5, loss_fn=_loss), oomless.SizeError, "1.5 is a fraction of a byte"),
    "memory in worked-out bytes": (lambda m, x: oomless.fit(m, x, 0.8 * 4364697.6, loss_fn=_loss), oomless.SizeError,
                                   "3491758.08 is a fraction of a byte; give whole bytes such as 3491758"),
    "memory nan": (lambda m, x: oomless.fit(m, x, float("nan"), loss_fn=_loss), oomless.SizeError, "finite"),
    "memory inf": (lambda m, x: oomless.plan(m, x, float("inf"), loss_fn=_loss), oomless.SizeError, "finite"),
    "memory None": (lambda m, x: oomless.plan(m, x, None, loss_fn=_loss), oomless.SizeError, "got NoneType"),
    "loss_fn not callable": (lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=3), oomless.InputError,
                             "loss_fn must be a callable"),
    "optimizer class": (lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss, optimizer=torch.optim.Adam),
                        oomless.InputError, "optimizer must be an instance"),
    "optimizer string": (lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss, optimizer="adam"),
                         oomless.InputError, "must be a torch.optim.Optimizer"),
    "optimizer of another model": (
        lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss,
                                  optimizer=torch.optim.Adam(torch.nn.Linear(2, 2).parameters())),
        oomless.InputError, "holds none of the model's parameters"),
    "blocks int": (lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss, blocks=3), oomless.InputError,
                   "blocks must be a list"),
    "blocks unknown": (lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss, blocks="nothere"), oomless.InputError,
                       "['nothere'] are not modules"),
    "decisions list": (lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss, decisions=["keep"]),
                       oomless.InputError, "decisions must be a dict"),
    # A name that is no block was dropped without a word: its block got another decision than meant.
    "decisions naming no block": (lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss, decisions={"featurs": "swap"}),
                                  oomless.InputError, "decisions name ['featurs'], which are not blocks"),
    # blocks= naming a module and one inside it keeps the outer: the inner one's decision says so.
    "decisions naming a block inside a block": (
        lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss, blocks=["blocks.0", "blocks.0.1"],
                                  decisions={"blocks.0.1": "swap"}),
        oomless.InputError, r"blocks.0.1 lies inside block blocks.0: blocks never overlap"),
    # Installed on the CPU, a plan for an H100 ran silently, its budget and times the H100's.
    "apply a target's plan on the CPU": (
        lambda m, x: oomless.apply(m, oomless.plan(m, x, "1GiB", loss_fn=_loss, target="h100")), oomless.ApplyError,
        "made for a h100"),
    "min_swap_bytes negative": (lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss, min_swap_bytes=-1),
                                oomless.InputError, "non-negative int"),
    "solver": (lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss, solver="fast"), oomless.InputError,
               "solver must be one of"),
    "dtype without target": (lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss, dtype=torch.bfloat16),
                             oomless.InputError, "dtype applies with target="),
    "dtype string": (lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss, target="h100", dtype="bf16"),
                     oomless.InputError, "floating torch.dtype"),
    "target unknown": (lambda m, x: oomless.plan(m, x, "1GiB", loss_fn=_loss, target="h900"), oomless.InputError,
                       "unknown target device"),
    "profile string": (lambda m, x: oomless.plan(m, x, "1GiB", profile="p"), oomless.InputError,
                       "profile must be an oomless Profile"),
    "profile model None": (lambda m, x: oomless.profile(None, x), oomless.InputError, "oomless.profile takes"),
    "apply a string": (lambda m, x: oomless.apply(m, "plan"), oomless.InputError, "apply expects an oomless.Plan"),
    "apply to None": (lambda m, x: oomless.apply(None, "plan"), oomless.InputError, "oomless.apply takes"),
    "remove None": (lambda m, x: oomless.remove(None), oomless.InputError, "oomless.remove takes"),
    "remove unapplied": (lambda m, x: oomless.remove(m), oomless.ApplyError, "not applied"),
    "stats None": (lambda m, x: oomless.stats(None), oomless.InputError, "oomless.stats takes"),
    "stats unapplied": (lambda m, x: oomless.stats(m), oomless.ApplyError, "not applied"),
    "plan from bad JSON": (lambda m, x: oomless.Plan.from_json("{"), oomless.InputError, "not a plan written by"),
    "plan from other JSON": (lambda m, x: oomless.Plan.from_json("{}"), oomless.InputError, "not a plan written by"),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_mistake_raises_one_clear_error_and_leaves_the_model_untouched(case):
    call, error_type, fragment = API_CASES[case]
    model, inputs = _model_and_inputs()
    before = copy.deepcopy(model)
    with pytest.raises(error_type) as raised:
        call(model, inputs)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)
    assert not hasattr(model, "_oomless")
    assert all(not module._forward_hooks and not module._forward_pre_hooks for module in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(before.state_dict().values(), model.state_dict().values()))


def test_a_refusal_is_one_error_not_a_chain():
    """Refused on the way to the refusal that names the budget (the unsplit step's, then with chains
    split), the traceback printed both, the first "During handling of the above exception"."""
    import traceback

    model, inputs = _model_and_inputs()
    with pytest.raises(oomless.PlanError) as raised:
        oomless.plan(model, inputs, 1, loss_fn=_loss)
    printed = "".join(traceback.format_exception(raised.value))
    assert printed.count("oomless.errors.PlanError") == 1 and "During handling" not in printed, printed[-3000:]


def test_input_the_model_cannot_take_leaves_it_untouched():
    """A wrong input shape is the model's own error (torch's message), raised from profiling: the
    model keeps no hook, its weights and buffers, and the RNG is where it was."""
    model, _ = _model_and_inputs()
    before, wrong_shape = copy.deepcopy(model), torch.randn(2, 5)
    torch.manual_seed(5)
    expected_draw = torch.rand(2)
    torch.manual_seed(5)
    with pytest.raises(RuntimeError, match="conv2d"):
        oomless.plan(model, wrong_shape, "1GiB", loss_fn=_loss)
    assert torch.equal(torch.rand(2), expected_draw)
    assert all(not module._forward_hooks and not module._forward_pre_hooks for module in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(before.state_dict().values(), model.state_dict().values()))
    assert all(parameter.grad is None for parameter in model.parameters())


def test_factory_in_the_current_directory_imports_without_pythonpath(tmp_path):
    """``oomless plan mymodels:make`` from the folder holding mymodels.py, started the way the
    installed ``oomless`` script starts (its own folder first on sys.path, not the current one)."""
    (tmp_path / "mymodels.py").write_text(
        "import torch\n\ndef make(width=8):\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))\n")
    launcher = tmp_path / "bin" / "oomless"
    launcher.parent.mkdir()
    launcher.write_text("import sys\nfrom oomless.cli.main import main\nsys.exit(main())\n")
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment["PYTHONPATH"] = str(SOURCE)
    completed = subprocess.run([sys.executable, str(launcher), "plan", "mymodels:make", "--input-shape", "3,4",
                                "--memory", "1GiB", "--model-arg", "width=16", "--json"],
                               capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert '"memory_bytes": 1073741824' in completed.stdout
    # From another folder it is not found, and the line says where it looked.
    elsewhere = subprocess.run([sys.executable, str(launcher), "plan", "mymodels:make", "--memory", "1GiB"],
                               capture_output=True, text=True, cwd=launcher.parent, env=environment, timeout=300)
    assert elsewhere.returncode == 2 and "cannot import module 'mymodels'" in elsewhere.stderr
    assert len(elsewhere.stderr.strip().splitlines()) == 1


def test_pipeline_cut_without_a_budget_prints_no_limit():
    from oomless.parallel.stage_fit import UNLIMITED
    from oomless.plan.partition import partition_stages
    from tests.test_partition import _generated_profile

    text = str(partition_stages(_generated_profile(0, 6), 2, [UNLIMITED, UNLIMITED]))
    line, = [line for line in text.splitlines() if line.startswith("bytes per rank:")]
    assert "TiB" not in line and " of " not in line, line
    budgeted = str(partition_stages(_generated_profile(0, 6), 2, "4GiB"))
    assert "bytes per rank: 0: " in budgeted and " of 4.00 GiB, 1: " in budgeted


def test_bad_flag_under_torchrun_is_reported_once(tmp_path):
    environment = {**os.environ, "PYTHONPATH": str(SOURCE)}
    completed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                "-m", "oomless", "train", "--parallel", "dp", "--size", "20", "--device", "cpu"],
                               capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=300)
    assert completed.returncode != 0
    errors = [line for line in completed.stderr.splitlines() if line.startswith("oomless train: error:")]
    assert errors == ["oomless train: error: size 20 must be positive and divisible by 2**depth = 8 (depth=3)"], \
        completed.stderr
    assert str(SOURCE) not in completed.stderr          # torchrun's own report, but no frame of oomless's


def _net_with_unannotated_defaults(dropout=0, flag=False):
    return torch.nn.Dropout(dropout) if flag else torch.nn.Identity()


def test_model_arguments_without_annotations_take_what_the_factory_takes():
    """A default's type is no promise (``dropout=0`` takes 0.2): only annotations are checked."""
    from oomless.models import build_model

    model = build_model("tests.test_bad_input:_net_with_unannotated_defaults", dropout=0.2, flag=1)
    assert isinstance(model, torch.nn.Dropout) and model.p == 0.2
