"""oomless.loss_in_slabs (src/oomless/runtime/loss_slabs.py): a loss computed slab by slab equals the
loss computed whole, within the rounding of a sum in another order, with the gradient PyTorch's own
backward gives; and it never makes the loss's per-element tensors whole."""

import pytest
import torch
import torch.nn.functional as F

import oomless
from oomless.errors import InputError
from oomless.profile.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss, return_freed_memory_to_the_system
from oomless.runtime.loss_slabs import reduce_in_slabs


def _both(loss, output, target, slabs=3, **keywords):
    """(whole value, whole gradient, slabbed value, slabbed gradient)."""
    output = output.detach().requires_grad_()
    whole = loss(output, target, **keywords)
    (whole_grad,) = torch.autograd.grad(whole, output)
    slabbed = oomless.loss_in_slabs(loss, output, target, slabs=slabs, **keywords)
    (slabbed_grad,) = torch.autograd.grad(slabbed, output)
    return whole, whole_grad, slabbed, slabbed_grad


CASES = {
    "cross-entropy 3D": (F.cross_entropy, (2, 3, 7, 5, 4), "classes", {}),
    "cross-entropy 2D, ignore_index": (F.cross_entropy, (2, 4, 9, 6), "classes", {"ignore_index": 1}),
    "cross-entropy, class weights": (F.cross_entropy, (2, 3, 8, 5), "classes", {"weight": torch.tensor([0.2, 1.0, 3.0])}),
    "cross-entropy, label smoothing, rows": (F.cross_entropy, (40, 7), "classes", {"label_smoothing": 0.1}),
    "cross-entropy, probabilities": (F.cross_entropy, (2, 3, 6, 5), "probabilities", {}),
    "cross-entropy, sum": (F.cross_entropy, (1, 2, 9, 4, 4), "classes", {"reduction": "sum"}),
    "mse": (F.mse_loss, (2, 3, 7, 5), "same", {}),
    "bce with logits": (F.binary_cross_entropy_with_logits, (1, 1, 10, 6, 6), "binary", {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_the_loss_computed_whole(case):
    loss, shape, kind, keywords = CASES[case]
    torch.manual_seed(0)
    output = torch.randn(*shape)
    classes = shape[1]
    if kind == "classes":
        target = torch.randint(0, classes, (shape[0], *shape[2:]))
    elif kind == "probabilities":
        target = torch.softmax(torch.randn(*shape), dim=1)
    elif kind == "binary":
        target = (torch.rand(*shape) > 0.5).float()
    else:
        target = torch.randn(*shape)
    whole, whole_grad, slabbed, slabbed_grad = _both(loss, output, target, **keywords)
    torch.testing.assert_close(slabbed, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(slabbed_grad, whole_grad, rtol=1e-6, atol=1e-9)


def test_the_model_trains_as_with_the_loss_computed_whole():
    """Three Adam steps of a small 3D network: the parameters stay within float rounding of the
    steps taken with F.cross_entropy."""
    def train(slabbed: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv3d(4, 3, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        volume = torch.randn(2, 1, 12, 8, 8)
        labels = torch.randint(0, 3, (2, 12, 8, 8))
        for _ in range(3):
            optimizer.zero_grad()
            output = model(volume)
            loss = oomless.loss_in_slabs(F.cross_entropy, output, labels, slabs=5) if slabbed \
                else F.cross_entropy(output, labels)
            loss.backward()
            optimizer.step()
        return [parameter.detach() for parameter in model.parameters()]

    for slabbed, whole in zip(train(True), train(False)):
        torch.testing.assert_close(slabbed, whole, rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_the_slabs_run_as_the_whole_loss_does():
    """Autocast runs cross-entropy in float32 whatever its input: so does every slab, in forward and
    again in backward (where autocast is not on by itself)."""
    torch.manual_seed(0)
    weight = torch.randn(3, 5, requires_grad=True)
    features = torch.randn(2, 5, 6, 4)
    labels = torch.randint(0, 3, (2, 6, 4))
    results = []
    for slabbed in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = torch.einsum("oc,nchw->nohw", weight, features)
            assert output.dtype == torch.bfloat16
            loss = oomless.loss_in_slabs(F.cross_entropy, output, labels, slabs=3) if slabbed \
                else F.cross_entropy(output, labels)
        assert loss.dtype == torch.float32
        # The logits' gradient: cross-entropy's backward in float32 as autocast ran it (outside
        # autocast the slabs would run it again in bfloat16, several units in the third digit off).
        (grad,) = torch.autograd.grad(loss, output)
        results.append((loss, grad))
    (whole, whole_grad), (slabbed, slabbed_grad) = results
    torch.testing.assert_close(slabbed, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(slabbed_grad, whole_grad, rtol=0, atol=0)


def test_general_form_a_ratio_of_sums():
    """reduce_in_slabs: a loss that is a function of whole-output sums (a soft Dice) and its gradient."""
    torch.manual_seed(0)
    logits = torch.randn(1, 2, 9, 5, 5, requires_grad=True)
    labels = torch.randint(0, 2, (1, 9, 5, 5))

    def dice(probabilities_and_targets):
        overlap, total = probabilities_and_targets
        return 1 - (2 * overlap + 1) / (total + 1)

    def partial(rows, target_rows):
        probability = torch.softmax(rows, dim=1)[:, 1]
        target = (target_rows == 1).to(probability.dtype)
        return torch.stack([(probability * target).sum(), probability.sum() + target.sum()])

    whole = dice(partial(logits, labels))
    (whole_grad,) = torch.autograd.grad(whole, logits)
    slabbed = reduce_in_slabs(partial, dice, logits, labels, slabs=4)
    (slabbed_grad,) = torch.autograd.grad(slabbed, logits)
    torch.testing.assert_close(slabbed, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(slabbed_grad, whole_grad, rtol=1e-5, atol=1e-8)


def test_a_partial_loss_and_a_sum_over_a_large_float16_volume():
    """Keywords bound with functools.partial count as given (ignore_index changes the mean's divisor);
    float16 partial sums add in float64, so a whole volume's sum does not overflow."""
    import functools

    torch.manual_seed(0)
    output, labels = torch.randn(2, 3, 9, 6), torch.randint(0, 3, (2, 9, 6))
    bound = functools.partial(F.cross_entropy, ignore_index=1)
    torch.testing.assert_close(oomless.loss_in_slabs(bound, output, labels, slabs=3),
                               F.cross_entropy(output, labels, ignore_index=1), rtol=1e-6, atol=0)
    large = torch.randn(1, 2, 48, 48, 48).half()
    target = torch.randint(0, 2, (1, 48, 48, 48))
    mean = oomless.loss_in_slabs(F.cross_entropy, large, target)       # one slab: its own sum would overflow
    assert mean.dtype == torch.float16
    # (PyTorch's own float16 cross-entropy on this CPU gives nan here: its sum overflows.)
    torch.testing.assert_close(mean.float(), F.cross_entropy(large.float(), target), rtol=1e-3, atol=0)
    summed = oomless.loss_in_slabs(F.cross_entropy, large, target, slabs=8, reduction="sum")
    assert not torch.isfinite(summed)       # over float16's 65504: the sum itself, in the loss's dtype


def test_bad_input_is_refused_with_what_would_work():
    output, labels = torch.randn(1, 2, 4, 4, 4), torch.randint(0, 2, (1, 4, 4, 4))
    with pytest.raises(InputError, match="reduction 'mean' or 'sum'"):
        oomless.loss_in_slabs(F.cross_entropy, output, labels, reduction="none")
    with pytest.raises(InputError, match="does not match an output"):
        oomless.loss_in_slabs(F.cross_entropy, output, labels[0, 0])
    with pytest.raises(InputError, match="rows along axis"):
        oomless.loss_in_slabs(F.cross_entropy, output, labels[:, :3])
    with pytest.raises(InputError, match="does not take reduction='sum'"):
        oomless.loss_in_slabs(lambda out, target: F.cross_entropy(out, target), output, labels)
    with pytest.raises(InputError, match="positive number of slabs"):
        oomless.loss_in_slabs(F.cross_entropy, output, labels, slabs=0)
    # A mean over other counts than the elements (multi_margin_loss averages over N): sum only.
    rows, row_labels = torch.randn(6, 4), torch.randint(0, 4, (6,))
    with pytest.raises(InputError, match="what multi_margin_loss's mean divides by"):
        oomless.loss_in_slabs(F.multi_margin_loss, rows, row_labels)
    torch.testing.assert_close(oomless.loss_in_slabs(F.multi_margin_loss, rows, row_labels, reduction="sum", slabs=2),
                               F.multi_margin_loss(rows, row_labels, reduction="sum"))
    with pytest.raises(InputError, match="no gradient for the target"):
        oomless.loss_in_slabs(F.mse_loss, output, torch.randn(1, 2, 4, 4, 4, requires_grad=True))


def _loss_peak_bytes(slabbed: bool, side: int) -> int:
    """Resident-memory rise of one loss forward and backward over existing logits (the gradient kept)."""
    torch.manual_seed(0)
    labels = torch.randint(0, 2, (1, side, side, side))
    logits = torch.randn(1, 2, side, side, side, requires_grad=True)
    def loss_fn(out, target):
        return oomless.loss_in_slabs(F.cross_entropy, out, target, slabs=16) if slabbed else F.cross_entropy(out, target)

    loss_fn(logits[:, :, :8, :8, :8], labels[:, :8, :8, :8]).backward()   # kernels' first-use allocations
    logits.grad = None
    return_freed_memory_to_the_system()
    reset_peak_rss()
    before = current_rss_bytes()
    loss_fn(logits, labels).backward()
    return peak_rss_bytes() - before


def test_only_the_gradient_is_whole():
    """Whole, cross-entropy keeps its log-probabilities and its backward makes their gradient and the
    logits' (three logits-sized tensors, 3 x 16 MiB at 128^3 with two classes); in 16 slabs only the
    logits' gradient (16 MiB) and a few 1 MiB slabs' temporaries."""
    side = 128
    logits_bytes = 2 * side**3 * 4
    whole, slabbed = _loss_peak_bytes(False, side), _loss_peak_bytes(True, side)
    assert whole > 2.5 * logits_bytes, whole
    assert slabbed < 1.5 * logits_bytes, (slabbed, whole)


@pytest.mark.parametrize("fused", [True, False])
def test_through_a_streamed_unet_it_trains_like_plain_pytorch_and_never_makes_the_output_whole(monkeypatch, fused):
    """On the output of a graph in slabs (a streamed U-Net's decoder), the loss runs that graph's
    backward itself, slab by slab into the loss: the graph's own backward never runs (it would need
    the output's gradient whole), and three SGD steps stay within 1e-5 of plain PyTorch's; also with
    the ReLUs of normalisations taken back through autograd (``fused`` off)."""
    import copy

    from oomless.models.unet3d import UNet3D
    from oomless.runtime import slabs as slabs_module

    monkeypatch.setattr(slabs_module, "FUSED_NORMALISED_RELU", fused)
    monkeypatch.setattr(slabs_module, "ONEDNN_MIN_INPUT_ELEMENTS", 0)       # thin slabs at this size
    torch.manual_seed(0)
    model = UNet3D(base_channels=4, depth=2)
    reference = copy.deepcopy(model)
    volume = torch.randn(2, 1, 16, 16, 16)
    labels = (volume[:, 0] > 0).to(torch.uint8)        # any integer dtype: each slab becomes int64

    plan = oomless.plan(model, volume, "4GiB", loss_fn=lambda out: oomless.loss_in_slabs(F.cross_entropy, out, labels),
                        split=True)
    oomless.apply(model, plan)
    graph_backwards = []
    original = slabs_module._SlabbedGraph.backward
    monkeypatch.setattr(slabs_module._SlabbedGraph, "backward",
                        staticmethod(lambda ctx, grad: graph_backwards.append(ctx.made.graph) or original(ctx, grad)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        optimizer.zero_grad()
        oomless.loss_in_slabs(F.cross_entropy, model(volume), labels).backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        F.cross_entropy(reference(volume), labels.long()).backward()
        reference_optimizer.step()
    # The chains below the outer level ran their own backward; the graph ending in the head did not.
    assert graph_backwards
    assert not any(node.module is model.head for graph in graph_backwards for node in graph.nodes)
    assert any(node.module is model.head for node in model._oomless_stream.decode.nodes)
    for (name, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        if value.is_floating_point():
            assert (value - expected).abs().max() <= 1e-5 * max(expected.abs().max().item(), 1.0), name
        else:
            assert torch.equal(value, expected), name


def _streamed_unet(monkeypatch):
    from oomless.models.unet3d import UNet3D
    from oomless.runtime import slabs as slabs_module

    monkeypatch.setattr(slabs_module, "ONEDNN_MIN_INPUT_ELEMENTS", 0)
    torch.manual_seed(0)
    model = UNet3D(base_channels=4, depth=2)
    volume = torch.randn(2, 1, 16, 16, 16)
    oomless.apply(model, oomless.plan(model, volume, "4GiB", loss_fn=oomless.sum_of_outputs, split=True))
    return model, volume


@pytest.mark.parametrize("case", ["weights and ignore_index", "mse", "two losses", "written in place"])
def test_through_a_streamed_output_it_gives_the_gradients_of_the_loss_computed_whole(monkeypatch, case):
    """The fused path (and its fall-back to the loss over the whole output, where the output was
    written into after the graph made it) against the same loss computed whole on the same model."""
    model, volume = _streamed_unet(monkeypatch)
    labels = torch.randint(0, 2, (2, 16, 16, 16))
    weight = torch.tensor([0.3, 2.0])
    target = torch.randn(2, 2, 16, 16, 16)

    def loss_of(output, in_slabs: bool):
        loss = (lambda *arguments, **keywords: oomless.loss_in_slabs(*arguments, **keywords)) if in_slabs \
            else (lambda function, *arguments, **keywords: function(*arguments, **keywords))
        if case == "weights and ignore_index":
            return loss(F.cross_entropy, output, labels, weight=weight, ignore_index=0)
        if case == "mse":
            return loss(F.mse_loss, output, target)
        if case == "two losses":
            return loss(F.cross_entropy, output, labels) + 0.5 * loss(F.mse_loss, output, target)
        output.mul_(2.0)                     # written into: no longer the graph's output as it made it
        return loss(F.cross_entropy, output, labels)

    gradients = []
    for in_slabs in (False, True):
        model.zero_grad(set_to_none=True)
        loss_of(model(volume), in_slabs).backward()
        gradients.append([parameter.grad.clone() for parameter in model.parameters()])
    for slabbed, whole in zip(*reversed(gradients)):
        torch.testing.assert_close(slabbed, whole, rtol=1e-5, atol=1e-7)


def test_a_streamed_output_keeps_nothing_alive_its_graph_does_not():
    """The record a graph in slabs leaves on its output holds no tensor: after a plain backward the
    graph's saved inputs are freed even while the output lives (else every level's inputs would
    stay alive with it, into the next step's forward)."""
    from oomless.models.unet3d import UNet3D

    torch.manual_seed(0)
    model = UNet3D(base_channels=4, depth=2)
    volume = torch.randn(1, 1, 32, 32, 32)
    oomless.apply(model, oomless.plan(model, volume, "4GiB", loss_fn=oomless.sum_of_outputs, split=True))
    output = model(volume)
    made = output._oomless_slabbed
    assert not any(isinstance(value, torch.Tensor) for value in vars(made).values())
    F.cross_entropy(output, (volume[:, 0] > 0).long()).backward()
    with pytest.raises(RuntimeError, match="freed"):
        made.forward.saved_tensors


@pytest.mark.parametrize("fused", [True, False])
def test_a_loss_whose_gradient_is_expanded_through_an_identity_after_a_relu(monkeypatch, fused):
    """A graph in slabs ending in Identity(ReLU(BatchNorm(conv))) and a loss of its sum: the gradient
    autograd hands back at the ReLU is the sum's, one value expanded over the slab; taking it back
    must not write into it (it raised "more than one element of the written-to tensor")."""
    import copy

    from oomless.runtime import slabs as slabs_module
    from oomless.runtime.slabs import SlabGraph, leaves, run_in_slabs

    monkeypatch.setattr(slabs_module, "FUSED_NORMALISED_RELU", fused)
    monkeypatch.setattr(slabs_module, "ONEDNN_MIN_INPUT_ELEMENTS", 0)
    torch.manual_seed(0)
    chain = torch.nn.Sequential(torch.nn.Conv3d(2, 3, 3, padding=1), torch.nn.BatchNorm3d(3), torch.nn.ReLU(),
                                torch.nn.Identity())
    reference = copy.deepcopy(chain)
    x, target = torch.randn(1, 2, 6, 4, 4), torch.randn(1, 3, 6, 4, 4)
    output = run_in_slabs(SlabGraph.chain(leaves(chain)), x, 3)
    reduce_in_slabs(lambda rows, _: rows.sum().reshape(1), lambda sums: sums[0], output, target).backward()
    reference(x).sum().backward()
    for (name, parameter), other in zip(chain.named_parameters(), reference.parameters()):
        assert (parameter.grad - other.grad).abs().max() <= 1e-5 * other.grad.abs().max() + 1e-5, name
