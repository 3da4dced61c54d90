"""A tensor saved for backward and changed in place afterwards: refused, as plain PyTorch refuses it.

Autograd checks a saved tensor's version at backward, but not for a tensor packed by
`saved_tensors_hooks`, as the plan's are. A model that changes a saved tensor in place (its own bug,
which plain PyTorch reports) trained silently: on the changed values where the plan kept the tensor
or recomputed its block (the recompute started from the changed input), and on whichever values
the copy out read where it swapped. oomless's own change in place, a ReLU(inplace=True) block's
recompute giving its input the same values again, is hidden from both checks, autograd's and the
plan's, in every backward of a graph kept for several (`runtime/saved_versions.py`). A saved tensor
no backward reads may change, as in plain PyTorch.
"""

import copy

import pytest
import torch
from torch import nn

import oomless

_CHANGED = "modified by an inplace operation"


def _loss(out):
    return out.square().mean()


def _assert_same_gradients(model, reference):
    """Every gradient plain PyTorch computed, equal in ``model`` (those it left None, None there too)."""
    gradients = {name: parameter.grad for name, parameter in model.named_parameters()}
    for name, parameter in reference.named_parameters():
        if parameter.grad is None:
            assert gradients[name] is None, name
        else:
            assert torch.equal(gradients[name], parameter.grad), name


class ChangesSaved(nn.Module):
    """``b`` saves its input ``h`` for its weight's gradient; the forward then doubles ``h`` in place."""

    def __init__(self, width=64):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, 1)
        self.change = True

    def forward(self, x):
        h = self.a(x)
        g = self.b(h)
        if self.change:
            h.mul_(2.0)
        return self.c(g)


@pytest.mark.parametrize("shape", [(256, 64), (8, 32, 64)], ids=["2d", "3d"])
@pytest.mark.parametrize("decision", ["keep", "swap", "recompute"])
def test_a_saved_tensor_changed_in_place_afterwards_is_refused_as_plain_pytorch_refuses_it(decision, shape):
    """64 KiB saved by b: large enough to swap. Of 3 dimensions, linear saves its input as a view
    of 2 made for the op alone: a swapped one is watched through its base."""
    torch.manual_seed(0)
    model, inputs = ChangesSaved(), torch.randn(*shape)
    reference = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match=_CHANGED):
        _loss(reference(inputs)).backward()
    model.change = False      # planned as the model was before the change was written
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss, blocks=["a", "b", "c"],
                        decisions={"a": "keep", "b": decision, "c": "keep"}, update_in_backward=False)
    assert plan.blocks[1].decision == decision
    oomless.apply(model, plan)
    model.change = True
    with pytest.raises(RuntimeError, match=_CHANGED + r".*(saved by|an input of) block b"):
        _loss(model(inputs)).backward()
    model.change = False      # the same plan trains the model without the change, as plain PyTorch does
    reference.change = False
    reference.zero_grad()     # the refused backwards had begun (the loss's and c's gradients)
    model.zero_grad()
    _loss(reference(inputs)).backward()
    _loss(model(inputs)).backward()
    _assert_same_gradients(model, reference)


def test_a_relu_in_place_changing_what_an_earlier_block_saved_is_refused_as_plain_pytorch_refuses_it():
    """The ReLU block's own change is allowed for its recompute, not for the sigmoid's saved output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Sigmoid(), nn.ReLU(inplace=True), nn.Linear(32, 1))
    inputs = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match=_CHANGED):
        _loss(copy.deepcopy(model)(inputs)).backward()
    blocks = ["0", "1", "2", "3"]
    decisions = {"0": "keep", "1": "keep", "2": "recompute", "3": "keep"}
    planned = nn.Sequential(*list(model)[:2], nn.ReLU(), model[3])    # the same step without the change in place
    plan = oomless.plan(planned, inputs, "1GiB", loss_fn=_loss, blocks=blocks, decisions=decisions,
                        update_in_backward=False)
    oomless.apply(model, plan)
    with pytest.raises(RuntimeError, match=_CHANGED + r".*saved by block 1"):
        _loss(model(inputs)).backward()


def test_three_backwards_through_a_recomputed_relu_in_place_equal_plain_pytorch():
    """Each recompute of the ReLU block raises its input's version again (same values); the next
    block's saved input and the ReLU block's own recompute input are read once per backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, 32), nn.ReLU(inplace=True),
                          nn.Linear(32, 1))
    reference, inputs = copy.deepcopy(model), torch.randn(16, 32)

    def step(net):
        loss = _loss(net(inputs))
        loss.backward(retain_graph=True)
        loss.backward(retain_graph=True)
        loss.backward()

    step(reference)
    blocks = [str(index) for index in range(5)]
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss, blocks=blocks, update_in_backward=False,
                        decisions={"0": "keep", "1": "recompute", "2": "keep", "3": "recompute", "4": "keep"})
    oomless.apply(model, plan)
    step(model)
    _assert_same_gradients(model, reference)


class DropsWhatSaved(nn.Module):
    """``b``'s output is computed and dropped (a metric taken with grad enabled); ``h``, which ``b``
    saved, is then changed in place: no backward reads it, and plain PyTorch trains."""

    def __init__(self, width=64):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, 1)

    def forward(self, x):
        h = self.a(x)
        self.b(h).sum().item()
        h.mul_(2.0)
        return self.c(h)


@pytest.mark.parametrize("decision", ["keep", "swap"])
def test_a_saved_tensor_whose_graph_was_dropped_may_change_in_place(decision):
    torch.manual_seed(0)
    model, inputs = DropsWhatSaved(), torch.randn(256, 64)
    reference = copy.deepcopy(model)
    _loss(reference(inputs)).backward()
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss, blocks=["a", "b", "c"],
                        decisions={"a": "keep", "b": decision, "c": "keep"}, update_in_backward=False)
    oomless.apply(model, plan)
    _loss(model(inputs)).backward()
    _assert_same_gradients(model, reference)


class ReturnsAux(nn.Module):
    """``b``'s output is returned beside the prediction and left out of the loss; ``h``, which ``b``
    saved, is changed in place after it: no backward reads ``b``'s saves, and plain PyTorch trains."""

    def __init__(self, width=64):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, 1)

    def forward(self, x):
        h = self.a(x)
        aux = self.b(h)
        h.mul_(2.0)
        return self.c(h), aux


@pytest.mark.parametrize("decision", ["keep", "swap"])
def test_a_changed_saved_tensor_no_backward_reads_trains_as_plain_pytorch(decision):
    """The profile's sizing step swaps every block: the plan itself must not refuse such a model."""
    torch.manual_seed(0)
    model, inputs = ReturnsAux(), torch.randn(256, 64)
    reference = copy.deepcopy(model)

    def loss_fn(out):
        return _loss(out[0])

    loss_fn(reference(inputs)).backward()
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=loss_fn, blocks=["a", "b", "c"],
                        decisions={"a": "keep", "b": decision, "c": "keep"}, update_in_backward=False)
    oomless.apply(model, plan)
    loss_fn(model(inputs)).backward()
    _assert_same_gradients(model, reference)


class Cell(nn.Module):
    """Keeps its output as a state for its next call, whose ``b`` saves it; ``act`` (a ReLU in place,
    recomputed) changed it in place in the call before, and its recompute in each backward changes it
    again, to the same values."""

    def __init__(self, width=64):
        super().__init__()
        self.a, self.act, self.b = nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, width)
        self.state = None

    def forward(self, x):
        if self.state is not None:
            x = x + self.b(self.state)
        self.state = self.act(self.a(x))
        return self.state


def test_a_recomputed_relu_in_place_of_one_forward_under_a_later_forwards_save_equals_plain_pytorch():
    torch.manual_seed(0)
    model, inputs = Cell(), torch.randn(256, 64)
    reference = copy.deepcopy(model)

    def step(net):
        net.state = None
        loss = net(inputs).sum() + net(inputs).sum()
        loss.backward(retain_graph=True)
        loss.backward()

    step(reference)
    planned = copy.deepcopy(model)

    def forward_after_a_call(x):       # b runs when profiled, each step on a state of its own
        planned.state = torch.randn_like(x)
        return Cell.forward(planned, x)

    planned.forward = forward_after_a_call
    plan = oomless.plan(planned, inputs, "1GiB", loss_fn=lambda out: out.sum(), blocks=["a", "act", "b"],
                        decisions={"a": "keep", "act": "recompute", "b": "keep"}, update_in_backward=False)
    oomless.apply(model, plan)
    step(model)
    _assert_same_gradients(model, reference)


def test_a_loss_that_saved_a_recomputed_relu_in_places_output_backward_twice_equals_plain_pytorch():
    """The loss saves the model's output outside the plan's hooks, under autograd's own check; the
    ReLU block's recompute changes that output in place (same values) before the second backward."""
    torch.manual_seed(0)
    model, inputs = nn.Sequential(nn.Linear(64, 64), nn.ReLU(inplace=True)), torch.randn(256, 64)
    reference = copy.deepcopy(model)

    def step(net):
        loss = _loss(net(inputs))
        loss.backward(retain_graph=True)
        loss.backward()

    step(reference)
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss, blocks=["0", "1"],
                        decisions={"0": "keep", "1": "recompute"}, update_in_backward=False)
    oomless.apply(model, plan)
    step(model)
    _assert_same_gradients(model, reference)


class ChangesOutsideBlocks(nn.Module):
    """The model's own forward, between its blocks, saves ``s`` (sigmoid saves its result) and may
    double it in place."""

    def __init__(self, width=64):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, 1)
        self.change = False

    def forward(self, x):
        s = torch.sigmoid(self.a(x))
        if self.change:
            s.mul_(2.0)
        return self.c(self.b(s))


def _planned(model, inputs, decisions):
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss, blocks=list(decisions), decisions=decisions,
                        update_in_backward=False, min_swap_bytes=0)
    return oomless.apply(model, plan)


@pytest.mark.parametrize("decision", ["keep", "swap"])
def test_an_optimizer_step_between_a_forward_and_its_backward_is_refused_as_plain_pytorch_refuses_it(decision):
    """The GAN loop's classic mistake: optimizer.step() changes the parameters the forward saved (b's
    and c's weights, saved for their inputs' gradients). The plan hands parameters back unwrapped
    (resident anyway) and trained on the stepped weights."""
    torch.manual_seed(0)
    model, inputs = ChangesOutsideBlocks(), torch.randn(256, 64)
    reference = copy.deepcopy(model)
    _planned(model, inputs, {"a": "keep", "b": decision, "c": "keep"})
    # Every block kept: the plan's hooks only count its first forwards, then autograd checks on its own.
    ours = _CHANGED if decision == "keep" else _CHANGED + r".*saved by block (b|c).*optimizer.step\(\)"
    for net, expected in ((reference, _CHANGED), (model, ours)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(3):       # past the forwards a plan of kept blocks counts under its hooks
            optimizer.zero_grad()
            _loss(net(inputs)).backward()
            optimizer.step()
        loss = _loss(net(inputs))
        optimizer.step()
        with pytest.raises(RuntimeError, match=expected):
            loss.backward()


@pytest.mark.parametrize("what", ["outside-blocks", "input"])
def test_a_save_outside_the_blocks_or_an_input_changed_in_place_is_refused_as_plain_pytorch_refuses_it(what):
    torch.manual_seed(0)
    model, inputs = ChangesOutsideBlocks(), torch.randn(256, 64, requires_grad=True)
    reference = copy.deepcopy(model)
    _planned(model, inputs, {"a": "swap", "b": "swap", "c": "keep"})

    def step(net):
        net.change = what == "outside-blocks"
        x = inputs.detach().clone().requires_grad_()
        out = net(x)
        if what == "input":
            with torch.no_grad():
                x.mul_(2.0)     # a's weight's gradient reads x
        _loss(out).backward()
    with pytest.raises(RuntimeError, match=_CHANGED):
        step(reference)
    saver = "the model's forward outside every block" if what == "outside-blocks" else "block a"
    with pytest.raises(RuntimeError, match=_CHANGED + f".*saved by {saver}"):
        step(model)


def test_a_change_under_allow_mutation_on_saved_tensors_says_that_context_does_not_see_the_plans_saves():
    """PyTorch's context clones a saved tensor before it changes, for the saves its own hooks see:
    not those the plan packs inside the model's forward. Refused, saying so (it trained on the
    changed values before the plan checked versions)."""
    torch.manual_seed(0)
    model, inputs = ChangesSaved(), torch.randn(256, 64)
    reference = copy.deepcopy(model)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        _loss(reference(inputs)).backward()         # plain PyTorch: cloned before the change, trains
    model.change = False
    plan = oomless.plan(model, inputs, "1GiB", loss_fn=_loss, blocks=["a", "b", "c"],
                        decisions={"a": "keep", "b": "swap", "c": "keep"}, update_in_backward=False)
    oomless.apply(model, plan)
    model.change = True
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        with pytest.raises(RuntimeError, match=_CHANGED + ".*allow_mutation_on_saved_tensors.*saved by block b"):
            _loss(model(inputs)).backward()
