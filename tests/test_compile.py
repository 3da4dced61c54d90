"""Regional torch.compile composed with every plan: oomless + compile equals plain compiled PyTorch.

The reference compiles the same blocks with ``torch.compile(block)`` on a deepcopy (torchtitan's
way) and trains plainly; both run the same compiled graphs, so the comparison is bit for bit. Compiling is
slow on a small shared CPU: the models are tiny and most cases use the ``aot_eager`` backend,
which runs AOTAutograd exactly as inductor does (one autograd function per block, saving what its
partitioner chose through ``ctx.save_for_backward``, where saved-tensor hooks apply) but skips
code generation; one test compiles with inductor itself.
"""

import copy

import pytest
import torch
import torch._dynamo.utils

import oomless
from oomless.errors import ApplyError, InputError
from oomless.models import TinyTransformer, UNet3D
from oomless.models.unet3d import ConvStage
from oomless.runtime import compile as compile_module
from tests.test_fit_equality import _assert_same, _train


def _case(depth=2):
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    model = TinyTransformer(vocab_size=64, dim=32, depth=depth, heads=2, max_len=16)
    return model, tokens, lambda out: torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens.flatten())


def compiled_reference(model, block_names, options):
    """Plain compiled PyTorch as torchtitan's apply_compile writes it: ``torch.compile(block)`` in
    each block's place (parameter names gain ``_orig_mod.``; `_assert_same` compares by position)."""
    reference = copy.deepcopy(model)
    for name in block_names:
        parent_name, _, child = name.rpartition(".")
        parent = reference.get_submodule(parent_name)
        parent.register_module(child, torch.compile(parent.get_submodule(child), **options))
    return reference


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def test_every_plan_on_compiled_blocks_equals_plain_compiled(fresh_dynamo):
    """keep, swap, recompute, a mix of the three (planned from the compiled profile, decisions forced
    in turn so no measured time picks them), and swap under bf16 autocast, on aot_eager-compiled
    blocks: bitwise the plain compiled model; no graph break anywhere (oomless's hooks, called
    while a compiled block runs, are kept out of dynamo), and the hooks see every saved tensor."""
    options = {"backend": "aot_eager"}
    model, tokens, loss_fn = _case()
    profile = oomless.profile(model, tokens, loss_fn=loss_fn, compile=options)
    assert profile.compiled
    cases = [("keep", "fp32"), ("swap", "fp32"), ("recompute", "fp32"), ("mixed", "fp32"), ("swap", "bf16")]
    for policy, precision in cases:
        model, tokens, loss_fn = _case()
        if policy == "mixed":
            plan = oomless.plan(model, tokens, "1TiB", profile=profile, min_swap_bytes=0, compile=options)
            plan = plan.with_decisions({name: ("swap", "recompute", "keep")[index % 3]
                                        for index, name in enumerate(plan.decisions)})
            assert set(plan.decisions.values()) == {"keep", "swap", "recompute"}, plan.decisions
        else:
            plan = oomless.plan(model, tokens, "1TiB", loss_fn=loss_fn, min_swap_bytes=0, compile=options,
                                precision=precision)
            plan = plan.with_decisions({name: policy for name in plan.decisions})
        assert plan.compile == options
        reference = compiled_reference(model, plan.decisions, options)
        oomless.apply(model, plan)
        assert all(model.get_submodule(name)._compiled_call_impl is not None for name in plan.decisions)

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            _train(reference, tokens, lambda out: loss_fn(out.float()))
        _train(model, tokens, loss_fn)

        _assert_same(reference, model)
        stats = oomless.stats(model)
        if policy == "swap":
            planned_bytes = sum(block.saved_bytes for block in plan.blocks)
            assert stats.offloaded_bytes == 2 * planned_bytes, "each step swaps every byte the compiled blocks save"
        if policy == "recompute":
            assert stats.recomputed_blocks >= 2 * len(plan.decisions) - 2   # as tests/test_fit_equality.py counts
        assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_inductor_blocks_profile_what_they_save_and_equal_plain_inductor(fresh_dynamo, one_thread):
    """With inductor the compiled blocks save other tensors than eager (its partitioner recomputes
    cheap ops in backward): the profile counts exactly what the plain compiled step packs, and
    training under swap equals plain inductor bit for bit. One thread: inductor's CPU kernel for
    the embedding's backward accumulates rows with atomic adds across threads, whose order (and
    so the float sum) varies from run to run even between two plain compiled runs; on one thread
    it is fixed, and both run the same graph and kernels."""
    options = {}
    model, tokens, loss_fn = _case(depth=1)
    eager = oomless.profile(model, tokens, loss_fn=loss_fn)
    compiled = oomless.profile(model, tokens, loss_fn=loss_fn, compile=True)
    plan = oomless.plan(model, tokens, "1TiB", profile=compiled, min_swap_bytes=0, compile=True)
    plan = plan.with_decisions({name: "swap" for name in plan.decisions})
    reference = compiled_reference(model, plan.decisions, options)

    resident = {t.untyped_storage().data_ptr() for t in (*reference.parameters(), *reference.buffers(), tokens)}
    packed = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in resident:
            packed[storage.data_ptr()] = storage.nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):   # the model's forward, as profiled
        output = reference(tokens)
    loss_fn(output).backward()
    reference.zero_grad(set_to_none=True)
    assert compiled.activation_bytes == sum(packed.values())
    assert [b.saved_bytes for b in compiled.blocks] != [b.saved_bytes for b in eager.blocks], \
        "inductor saves other tensors than eager"

    oomless.apply(model, plan)
    _train(reference, tokens, loss_fn)
    _train(model, tokens, loss_fn)
    _assert_same(reference, model)
    assert oomless.stats(model).offloaded_bytes > 0


def test_remove_uncompiles_only_what_oomless_compiled(fresh_dynamo):
    model, tokens, loss_fn = _case()
    model.token_embedding.compile(backend="aot_eager")          # a block the user compiled: theirs, kept
    oomless.fit(model, tokens, "1TiB", loss_fn=loss_fn, compile={"backend": "aot_eager"})
    assert "token_embedding" in oomless.installed_plan(model).decisions
    oomless.remove(model)
    assert model.token_embedding._compiled_call_impl is not None
    assert all(module._compiled_call_impl is None for name, module in model.named_modules()
               if name != "token_embedding")
    assert not hasattr(model, "_oomless_compiled")


def test_combinations_that_do_not_compose_are_refused(fresh_dynamo, monkeypatch):
    model, tokens, loss_fn = _case(depth=1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(InputError, match="compile must be True, False or a dict"):
        oomless.plan(model, tokens, "1TiB", loss_fn=loss_fn, compile="yes")
    with pytest.raises(InputError, match="cannot be profiled for a target device"):
        oomless.plan(model, tokens, "80GiB", loss_fn=loss_fn, target="h100", compile=True)
    plan = oomless.plan(model, tokens, "1TiB", loss_fn=loss_fn, compile={"backend": "aot_eager"})

    with torch._dynamo.config.patch(compiled_autograd=True), \
            pytest.raises(ApplyError, match=r"compiled autograd .* \(pytorch#143176\)"):
        oomless.apply(model, plan)

    whole = torch.compile(model, backend="aot_eager")
    with pytest.raises(ApplyError, match="already compiled as a whole"):
        oomless.plan(whole, tokens, "1TiB", loss_fn=loss_fn, compile={"backend": "aot_eager"})
    model.compile(backend="aot_eager")
    with pytest.raises(ApplyError, match="the model is already compiled as a whole"):
        oomless.apply(model, plan)
    model._compiled_call_impl = None

    monkeypatch.setattr(compile_module, "_probe", lambda backend: "RuntimeError: Python 3.14 is not supported")
    with pytest.raises(InputError, match=r"torch.compile is not available here .*\(compile=False"):
        oomless.fit(model, tokens, "1TiB", loss_fn=loss_fn, compile=True)
    with pytest.raises(InputError, match="not available here"):
        oomless.apply(model, plan)

    assert not hasattr(model, "_oomless") and not hasattr(model, "_oomless_compiled")
    assert all(module._compiled_call_impl is None for module in model.modules())
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_a_torch_nn_block_without_plan_hooks_is_really_compiled(fresh_dynamo):
    """``--compile`` without a budget compiles blocks that carry no plan hooks. Dynamo skips a
    ``forward`` frame in torch's files (torch 2.13 unless the module is of a torch.nn class and has a
    hook, torch 2.11 always): a torch.nn block, and a subclass keeping torch's forward (the U-Net's
    ConvStage, a Sequential: no graph at all before), run through a frame of oomless's."""
    from oomless.runtime.compile import apply_compile, remove_compile

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    apply_compile(model, ["0", "1"], {"backend": "aot_eager"})
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    remove_compile(model)
    assert not model[0]._forward_pre_hooks and model[0]._compiled_call_impl is None
    assert "forward" not in vars(model[0])
    unet = UNet3D(base_channels=2, depth=2)
    stages = [name for name, module in unet.named_modules() if isinstance(module, ConvStage)]
    apply_compile(unet, stages, {"backend": "aot_eager"})
    unet(torch.randn(1, 1, 8, 8, 8)).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2 + len(stages) == 7
    remove_compile(unet)
    assert not any("forward" in vars(module) for module in unet.modules())


def test_more_blocks_of_one_class_than_dynamos_recompile_limit_all_run_compiled(fresh_dynamo):
    """Twelve Linear blocks of twelve shapes share Linear.forward's code: each needs a graph of its
    own, and past dynamo's recompile_limit (8) the rest would silently run eagerly (a 3D U-Net's
    convolutions did). oomless raises the limit to one graph per block (plus a margin), and a
    backend given as a callable (as torch.compile takes it) is accepted."""
    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    widths = [8 + 4 * index for index in range(13)]
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    inputs = torch.randn(2, widths[0])
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=lambda out: out.square().mean(), compile={"backend": counting})
    oomless.apply(model, plan)
    model(inputs).square().mean().backward()
    assert len(plan.decisions) == 12 and len(graphs) >= 12, (len(plan.decisions), len(graphs))
    assert torch._dynamo.config.recompile_limit >= 12
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] == frames["total"], dict(frames)


def test_a_model_compiled_as_a_whole_after_apply_is_warned_that_its_plan_does_not_run(fresh_dynamo):
    """``torch.compile(model)`` after `oomless.apply`: the graph saves its tensors once the blocks
    have run, so no block's decision applies (every swap plan moves nothing) while training stays
    right. Backward's first unpack says so, once, naming the loop's line; the same plan in eager
    mode, and the plan compiled by oomless (``compile=``), say nothing."""
    import warnings

    def step(model, tokens, loss_fn) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss_fn(model(tokens)).backward()
        found = [warning for warning in caught if "compiled as a whole" in str(warning.message)]
        assert all(warning.filename == __file__ for warning in found), "names the loop's line"
        return [str(warning.message) for warning in found]

    model, tokens, loss_fn = _case()
    blocks = [name for name, _ in model.named_modules() if name.startswith("blocks.") and name.count(".") == 1]
    oomless.fit(model, tokens, "1GiB", loss_fn=loss_fn, blocks=blocks, decisions=dict.fromkeys(blocks, "swap"),
                min_swap_bytes=0)
    assert step(model, tokens, loss_fn) == [] and oomless.stats(model).offloaded_bytes > 0
    whole = torch.compile(model, backend="aot_eager")
    moved = oomless.stats(model).offloaded_bytes
    warned = step(whole, tokens, loss_fn)
    assert len(warned) == 1 and "oomless.plan(..., compile=True)" in warned[0], warned
    assert oomless.stats(model).offloaded_bytes == moved           # what the warning is about
    assert step(whole, tokens, loss_fn) == []                       # once
    assert step(model, tokens, loss_fn) == []

    compiled, tokens, loss_fn = _case()
    oomless.fit(compiled, tokens, "1GiB", loss_fn=loss_fn, blocks=blocks, decisions=dict.fromkeys(blocks, "swap"),
                min_swap_bytes=0, compile={"backend": "aot_eager"})
    assert step(compiled, tokens, loss_fn) == [] and oomless.stats(compiled).offloaded_bytes > 0
