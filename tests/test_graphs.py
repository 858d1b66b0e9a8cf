"""CPU tests of the CUDA-graph manager's bookkeeping, through the rerun backend.

The rerun backend "captures" by running a function once and "replays" by running it again
and copying the results into the static tensors of the capture, so everything around it --
static inputs, static gradient buffers, slots, keys, None handling, gradient routing --
is the code the CUDA path runs. tests/gpu/test_graphs_gpu.py proves graphed == eager on a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import tempfile

import pytest
import torch
import torch.nn as nn

from vitgraph.graphs import GraphManager, GraphsConfig, RerunBackend
from vitgraph.graphs import cudnn as gcudnn
from vitgraph.graphs import manager as gmanager
from vitgraph.graphs import tree
from vitgraph.graphs.te_impl import _kwargs_for


# ----------------------------------------------------------------------------------------------
# helpers

Pair = collections.namedtuple("Pair", "hidden context")


class Toy(nn.Module):
    """A small layer whose output structure is chosen per test."""

    def __init__(self, width=8, kind="tuple", dropout=0.0, unused=False):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.lin2 = nn.Linear(width, width)
        self.kind = kind
        self.drop = nn.Dropout(dropout)
        if unused:
            self.unused = nn.Linear(width, width)

    def forward(self, hidden_states, attention_mask=None, context=None, scale=1.0, flag=True):
        h = self.drop(torch.tanh(self.lin(hidden_states)))
        if attention_mask is not None:
            h = h * attention_mask
        y = self.lin2(h) * scale + hidden_states
        k = self.kind
        if k == "tuple":
            return y, None
        if k == "none_first":
            return (None, y)
        if k == "list":
            return [None, y, 3, "tag", h]
        if k == "dict":
            return {"hidden": y, "context": None, "aux": (h * 2, None, flag)}
        if k == "nested":
            return ((y, [None, {"a": h, "b": None}]), None, 1.5)
        if k == "namedtuple":
            return Pair(y, None)
        if k == "tensor":
            return y
        raise ValueError(k)


def manager_for(layers, backend=None, **cfg):
    cfg = {"enabled": True, "warmup_steps": 0, "capture_warmup_iters": 1, **cfg}
    return GraphManager(GraphsConfig(**cfg), layers, backend=backend or RerunBackend()).apply()


def assert_same_tree(a, b, **tol):
    la, sa = tree.flatten(a)
    lb, sb = tree.flatten(b)
    assert sa == sb
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, **tol)


def assert_grads_equal(m1, m2, attr="grad"):
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        a, b = getattr(p, attr, None), getattr(q, attr, None)
        if a is None or b is None:
            assert a is None and b is None, n
        else:
            torch.testing.assert_close(a, b, msg=n)


def leaf_loss(out):
    leaves, _ = tree.flatten(out)
    return sum((t.float() ** 2).sum() * (i + 1) for i, t in enumerate(leaves) if t.requires_grad)


# ----------------------------------------------------------------------------------------------
# tree and config


@pytest.mark.parametrize("obj", [
    (1, None, "s"),
    [None, [None, (None,)]],
    {"a": None, "b": [1, 2.5, None], "c": {"d": torch.float32}},
    Pair(None, 3),
    collections.OrderedDict(x=None, y=(None, "z")),
    None,
])
def test_tree_roundtrip(obj):
    t = torch.ones(2)
    wrapped = (obj, t, [t, obj], {"k": obj, "t": t})
    leaves, spec = tree.flatten(wrapped)
    assert len(leaves) == 3 and all(x is t for x in leaves)
    hash(spec)
    back = tree.unflatten([torch.zeros(2)] * 3, spec)
    assert tree.flatten(back)[1] == spec
    assert back[0] == obj if not isinstance(obj, dict) else back[0] == obj
    assert type(back[0]) is type(obj)


def test_tree_rejects_objects():
    class Holder:
        pass

    with pytest.raises(tree.Unsupported):
        tree.flatten((torch.ones(1), Holder()))


@pytest.mark.parametrize("key,value", [
    ("impl", "cuda"), ("on_new_shape", "skip"), ("warmup_steps", -1), ("max_slots", 0),
    ("scope", "model"), ("enabled", "yes"), ("capture_warmup_iters", 1.5),
])
def test_config_rejects(key, value):
    with pytest.raises(ValueError, match=rf"graphs\.{key}"):
        GraphsConfig(**{key: value})


def test_config_from_dict():
    assert GraphsConfig.from_dict({"enabled": True, "impl": "te"}).impl == "te"
    with pytest.raises(ValueError, match="graphs.bogus"):
        GraphsConfig.from_dict({"bogus": 1})


# ----------------------------------------------------------------------------------------------
# outputs with None / non-tensor leaves, gradient routing


@pytest.mark.parametrize("kind", ["tuple", "none_first", "list", "dict", "nested", "namedtuple", "tensor"])
def test_output_trees_pass_through(kind):
    torch.manual_seed(0)
    eager = Toy(kind=kind)
    graphed = copy.deepcopy(eager)
    mgr = manager_for([graphed])
    mgr.step_begin(0)
    for step in range(3):
        x = torch.randn(4, 8, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        mask = (torch.rand(4, 8) > 0.3).float()
        out_g = graphed(x, attention_mask=mask, scale=0.5)
        out_e = eager(xe, attention_mask=mask, scale=0.5)
        assert_same_tree(out_g, out_e)
        leaf_loss(out_g).backward()
        leaf_loss(out_e).backward()
        torch.testing.assert_close(x.grad, xe.grad)
        assert_grads_equal(graphed, eager)
        mgr.step_begin(step + 1)
    s = mgr.stats()
    assert s["graph_sets"] == 1 and s["slots"] == 1 and s["captures"] == 1
    assert s["replays"] == 3 and s["eager_fallbacks"] == {}


def test_gradient_routing_inputs_and_unused_params():
    torch.manual_seed(1)
    eager = Toy(unused=True)
    graphed = copy.deepcopy(eager)
    mgr = manager_for([graphed])
    mgr.step_begin(0)
    base = torch.randn(4, 8, requires_grad=True)
    base_e = base.detach().clone().requires_grad_()
    x, xe = base * 2, base_e * 2  # non-leaf inputs
    mask = torch.rand(4, 8, requires_grad=False)
    y, ctx = graphed(hidden_states=x, attention_mask=mask, context=None)
    ye, _ = eager(hidden_states=xe, attention_mask=mask, context=None)
    assert ctx is None
    assert not mask.requires_grad
    (y ** 3).sum().backward()
    (ye ** 3).sum().backward()
    torch.testing.assert_close(base.grad, base_e.grad)
    assert graphed.unused.weight.grad is None and eager.unused.weight.grad is None
    assert_grads_equal(graphed, eager)


def test_input_without_grad_and_frozen_params_run_forward_only():
    torch.manual_seed(2)
    eager = Toy()
    graphed = copy.deepcopy(eager)
    for m in (eager, graphed):
        m.requires_grad_(False)
    mgr = manager_for([graphed])
    mgr.step_begin(0)
    x = torch.randn(4, 8)
    for _ in range(3):  # no backward ever comes: the slot must be free again right away
        y, _ = graphed(x)
        assert not y.requires_grad
        torch.testing.assert_close(y, eager(x)[0])
    assert mgr.stats()["slots"] == 1


def _main_grad_hooks(module):
    """Mimic megatron DDP: accumulate .grad into main_grad, then drop .grad."""
    for p in module.parameters():
        p.main_grad = torch.zeros_like(p)

        def hook(param):
            param.main_grad.add_(param.grad)
            param.grad = None

        p.register_post_accumulate_grad_hook(hook)


def _grad_acc_node_hooks(module):
    """megatron 0.16.1's actual mechanism: a post-hook on each param's AccumulateGrad node."""
    keep = []
    for p in module.parameters():
        p.main_grad = torch.zeros_like(p)
        acc = p.expand_as(p).grad_fn.next_functions[0][0]

        def hook(*_, param=p):
            if param.grad is not None:
                param.main_grad.add_(param.grad)
            param.grad = None

        acc.register_hook(hook)
        keep.append(acc)
    module._acc_keep = keep


@pytest.mark.parametrize("hooks", [_main_grad_hooks, _grad_acc_node_hooks])
def test_main_grad_like_megatron_ddp(hooks):
    torch.manual_seed(3)
    eager = Toy()
    graphed = copy.deepcopy(eager)
    hooks(eager)
    hooks(graphed)
    mgr = manager_for([graphed])
    mgr.step_begin(0)
    for _ in range(4):  # microbatches accumulate into main_grad
        x = torch.randn(4, 8)
        leaf_loss(graphed(x)).backward()
        leaf_loss(eager(x)).backward()
    assert_grads_equal(graphed, eager, attr="main_grad")
    assert all(p.grad is None for p in graphed.parameters())


def test_grad_accumulation_into_dot_grad_with_one_slot():
    """.grad accumulates across microbatches while each backward replays the same slot:
    autograd steals the slot's buffer as .grad at the first backward; the copy-on-conflict
    guard must keep the second replay from overwriting it."""
    torch.manual_seed(4)
    eager = Toy()
    graphed = copy.deepcopy(eager)
    mgr = manager_for([graphed], max_slots=1)
    mgr.step_begin(0)
    for _ in range(3):
        x = torch.randn(4, 8)
        leaf_loss(graphed(x)).backward()
        leaf_loss(eager(x)).backward()
    assert_grads_equal(graphed, eager)
    assert mgr.stats()["slots"] == 1


def test_interleaved_microbatches_use_slots():
    """1F1B-like order F0 F1 B0 F2 B1 B2: slot A's backward after slot B's forward."""
    torch.manual_seed(5)
    eager = Toy(dropout=0.0)
    graphed = copy.deepcopy(eager)
    mgr = manager_for([graphed])
    mgr.step_begin(0)
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]  # leaf inputs (a stage's recv)
    xes = [x.detach().clone().requires_grad_() for x in xs]
    outs, outs_e = {}, {}
    for op in ["F0", "F1", "B0", "F2", "B1", "B2"]:
        i = int(op[1])
        if op[0] == "F":
            outs[i] = graphed(xs[i])[0]
            outs_e[i] = eager(xes[i])[0]
            torch.testing.assert_close(outs[i], outs_e[i])
        else:
            (outs[i] ** 2).sum().backward()
            (outs_e[i] ** 2).sum().backward()
    for x, xe in zip(xs, xes):
        torch.testing.assert_close(x.grad, xe.grad)
    assert_grads_equal(graphed, eager)
    s = mgr.stats()
    assert s["slots"] == 2 and s["captures"] == 2 and s["replays"] == 3


def test_slots_exhausted_runs_eagerly_and_correctly():
    torch.manual_seed(6)
    eager = Toy()
    graphed = copy.deepcopy(eager)
    mgr = manager_for([graphed], max_slots=1)
    mgr.step_begin(0)
    xs = [torch.randn(4, 8) for _ in range(3)]
    outs = [graphed(x)[0] for x in xs]  # 3 in flight, 1 slot
    outs_e = [eager(x)[0] for x in xs]
    for o, oe in zip(outs, outs_e):
        torch.testing.assert_close(o, oe)
    sum((o ** 2).sum() for o in outs).backward()
    sum((o ** 2).sum() for o in outs_e).backward()
    assert_grads_equal(graphed, eager)
    assert mgr.stats()["eager_fallbacks"] == {"slots_exhausted": 2}


def test_two_layers_share_a_pool_and_chain():
    torch.manual_seed(7)
    eager = nn.ModuleList([Toy(), Toy()])
    graphed = copy.deepcopy(eager)
    mgr = manager_for(list(graphed))
    mgr.step_begin(0)

    def run(layers, x):
        h = x
        for layer in layers:
            h, ctx = layer(hidden_states=h, context=None)
            assert ctx is None
        return h

    for _ in range(2):
        xs = [torch.randn(4, 8) for _ in range(2)]
        hs = [run(graphed, x) for x in xs]  # two microbatches in flight through both layers
        hes = [run(eager, x) for x in xs]
        for h, he in zip(reversed(hs), reversed(hes)):
            (h ** 2).sum().backward()
            (he ** 2).sum().backward()
    assert_grads_equal(graphed, eager)
    assert mgr.stats()["slots"] == 4


class PoolLog(RerunBackend):
    """The rerun backend, recording which pool each capture went into."""

    def __init__(self):
        super().__init__()
        self.pools = []

    def make_pool(self):
        return object()

    def capture(self, fn, pool):
        self.pools.append(pool)
        return super().capture(fn, pool)


def test_shared_pool_captures_in_run_order_without_copies_and_equals_eager():
    """pool=shared (no pipeline): each layer's forward is captured at its first call and its
    backward at its first backward, so the captures follow the step's own order, all into
    one pool per capture step; a layer's static input is the previous layer's output and its
    incoming-gradient buffer the next layer's input gradient (nothing is copied between
    layers). Gradients over sequential microbatches equal eager."""
    torch.manual_seed(17)
    eager = nn.ModuleList([Toy(), Toy(), Toy()])
    graphed = copy.deepcopy(eager)
    backend = PoolLog()
    mgr = manager_for(list(graphed), backend=backend, pool="shared")
    assert mgr.stats()["pool"] == "shared"

    def forward(layers, x):
        h = x
        for layer in layers:
            h, _ = layer(hidden_states=h)
        return h

    for step in range(3):
        mgr.step_begin(step)
        for _ in range(2):  # microbatches one after the other, as megatron without a pipeline
            x = torch.randn(4, 8)
            h = forward(graphed, x)
            if step == 0 and backend.captures == 3:
                assert len(set(map(id, backend.pools))) == 1  # three forwards, one pool
            leaf_loss(h).backward()
            leaf_loss(forward(eager, x)).backward()
            if step == 0:
                assert backend.captures == 6  # then the three backwards, in the same pool
        assert_grads_equal(graphed, eager)
    assert len(set(map(id, backend.pools))) == 1
    s = mgr.stats()
    assert s["slots"] == 3 and s["captures"] == 3 and s["replays"] == 18, s
    slots = [next(iter(layer.callable.sets.values()))[0]
             for layer in mgr.layers]
    for a, b in zip(slots, slots[1:]):
        assert b.static_in[0].data_ptr() == a.fwd.outputs[0].data_ptr()  # no input copy
        assert a.grad_bufs[0].data_ptr() == b.bwd.outputs[0].data_ptr()  # no gradient copy
    # a reset captures again, into a new pool
    mgr.reset()
    mgr.step_begin(3)
    leaf_loss(forward(graphed, torch.randn(4, 8))).backward()
    assert len(set(map(id, backend.pools))) == 2 and backend.captures == 12


def test_shared_pool_first_backward_with_an_unused_output_and_a_leaf_input():
    """The first backward of an ordered slot captures it: an output that got no gradient has
    a zero buffer, and a leaf input (a pipeline stage's received activation) gets its own
    gradient copy, as with per-slot pools."""
    torch.manual_seed(18)
    eager = Toy(kind="list")  # [None, y, 3, "tag", h]
    graphed = copy.deepcopy(eager)
    mgr = manager_for([graphed], pool="shared")
    for step in range(2):
        mgr.step_begin(step)
        x = torch.randn(4, 8, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        (graphed(x)[1] ** 2).sum().backward()  # h (index 4) gets no gradient
        (eager(xe)[1] ** 2).sum().backward()
        torch.testing.assert_close(x.grad, xe.grad)
        assert_grads_equal(graphed, eager)


def test_pool_auto_is_shared_only_without_a_pipeline_under_megatron_ddp(monkeypatch):
    # no megatron parallel state, whatever an earlier test of the process left behind
    monkeypatch.setattr(gmanager, "_megatron_pipeline_size", lambda: None)

    def mode(pp, ddp):
        mgr = GraphManager(GraphsConfig(enabled=True), [Toy()], backend=RerunBackend(), pipeline_size=pp)
        mgr._ddp = ddp
        return mgr.apply().stats()["pool"]
    assert mode(1, True) == "shared"
    assert mode(2, True) == "slot"
    assert mode(1, False) == "slot"  # plain .grad accumulation: per-slot pools
    assert mode(None, True) == "slot"  # pipeline size unknown (no megatron parallel state)


def test_shared_pool_copies_what_no_ordered_slot_owns_and_frees_kept_grads_before_any_replay():
    """An expanded mask and the caller's input are copied into the slot's own buffers (a copy
    into an alias of them would write the caller's memory; into an expanded one it fails);
    a parameter gradient autograd kept as .grad from an ordered slot is copied out before the
    next replay of *any* ordered graph (an earlier-captured graph may reuse that memory)."""
    torch.manual_seed(19)
    eager = nn.ModuleList([Toy(), Toy()])
    graphed = copy.deepcopy(eager)
    mgr = manager_for(list(graphed), pool="shared")
    mask = torch.ones(1, 8).expand(4, 8)

    def forward(layers, x):
        h = x
        for layer in layers:
            h, _ = layer(hidden_states=h, attention_mask=mask)
        return h

    for step in range(3):
        mgr.step_begin(step)
        for _ in range(2):
            x = torch.randn(4, 8)
            h = forward(graphed[:1], x)  # layer 0 replays before layer 1 unaliases its own
            if step > 0:
                owned = {t.data_ptr() for st in mgr.layers for v in st.callable.sets.values()
                         for slot in v for t in slot.owned()}
                assert all(p.grad is None or p.grad.data_ptr() not in owned
                           for p in graphed.parameters())
            h, _ = graphed[1](hidden_states=h, attention_mask=mask)
            leaf_loss(h).backward()
            leaf_loss(forward(eager, x)).backward()
        assert_grads_equal(graphed, eager)
    first = next(iter(mgr.layers[0].callable.sets.values()))[0]
    assert first.static_in[0].data_ptr() != x.data_ptr()  # the caller's input: copied


# ----------------------------------------------------------------------------------------------
# keys, warm-up, unseen shapes, reset, parameter replacement, restore, eval / no_grad


def test_two_shapes_two_graph_sets():
    torch.manual_seed(8)
    eager = Toy()
    graphed = copy.deepcopy(eager)
    mgr = manager_for([graphed])
    for step in range(3):
        mgr.step_begin(step)
        for n in (4, 6):  # two image sizes in one run: sequence lengths 4 and 6
            x = torch.randn(n, 8)
            leaf_loss(graphed(x)).backward()
            leaf_loss(eager(x)).backward()
    assert_grads_equal(graphed, eager)
    s = mgr.stats()
    assert s["graph_sets"] == 2 and s["captures"] == 2 and s["unseen_shapes"] == 0


@pytest.mark.parametrize("policy", ["eager", "capture"])
def test_unseen_shape_policy(policy):
    torch.manual_seed(9)
    eager = Toy()
    graphed = copy.deepcopy(eager)
    mgr = manager_for([graphed], on_new_shape=policy)
    mgr.step_begin(0)  # capture step: shape 4
    leaf_loss(graphed(torch.randn(4, 8))).backward()
    mgr.step_begin(1)
    for _ in range(2):
        x = torch.randn(5, 8)  # unseen after the capture step
        leaf_loss(graphed(x)).backward()
        leaf_loss(eager(x)).backward()
    s = mgr.stats()
    assert s["unseen_shapes"] == 1
    if policy == "eager":
        assert s["eager_fallbacks"] == {"unseen_shape": 2} and s["graph_sets"] == 1
    else:
        assert s["eager_fallbacks"] == {} and s["graph_sets"] == 2


def test_warmup_steps_then_capture():
    torch.manual_seed(10)
    eager = Toy()
    graphed = copy.deepcopy(eager)
    mgr = manager_for([graphed], warmup_steps=2, on_new_shape="eager")
    shapes = [6, 4, 4, 6]  # shape 6 is seen during warm-up: not "unseen" later
    for step, n in enumerate(shapes):
        mgr.step_begin(step)
        x = torch.randn(n, 8)
        leaf_loss(graphed(x)).backward()
        leaf_loss(eager(x)).backward()
        assert mgr.stats()["captures"] == (0 if step < 2 else (1 if step == 2 else 2))
    assert_grads_equal(graphed, eager)
    s = mgr.stats()
    assert s["eager_fallbacks"] == {"warmup": 2} and s["unseen_shapes"] == 0


def test_reset_recaptures():
    torch.manual_seed(11)
    eager = Toy()
    graphed = copy.deepcopy(eager)
    mgr = manager_for([graphed])
    for step in range(3):
        mgr.step_begin(step)
        if step == 2:
            # a checkpoint load, in place, then reset()
            sd = {k: v + 0.1 for k, v in eager.state_dict().items()}
            eager.load_state_dict(sd)
            graphed.load_state_dict(sd)
            mgr.reset()
        x = torch.randn(4, 8)
        y, ye = graphed(x)[0], eager(x)[0]
        torch.testing.assert_close(y, ye)
        (y ** 2).sum().backward()
        (ye ** 2).sum().backward()
    assert_grads_equal(graphed, eager)
    s = mgr.stats()
    assert s["captures"] == 2 and s["recaptures"] == {"reset": 1} and s["slots"] == 1


@pytest.mark.parametrize("how", ["new_parameter", "data_swap", "freeze"])
def test_parameter_replacement_detected(how):
    torch.manual_seed(12)
    eager = Toy()
    graphed = copy.deepcopy(eager)
    mgr = manager_for([graphed])
    mgr.step_begin(0)
    leaf_loss(graphed(torch.randn(4, 8))).backward()
    eager.zero_grad(set_to_none=True)
    graphed.zero_grad(set_to_none=True)
    new_w = torch.randn(8, 8)
    for m in (eager, graphed):
        if how == "new_parameter":
            m.lin.weight = nn.Parameter(new_w.clone())
        elif how == "data_swap":
            m.lin.weight.data = new_w.clone()
        else:
            m.lin2.weight.requires_grad_(False)
    mgr.step_begin(1)
    x = torch.randn(4, 8)
    y, ye = graphed(x)[0], eager(x)[0]
    torch.testing.assert_close(y, ye)
    (y ** 2).sum().backward()
    (ye ** 2).sum().backward()
    assert_grads_equal(graphed, eager)
    s = mgr.stats()
    assert s["recaptures"] == {"params_changed": 1} and s["captures"] == 2


def test_restore_and_state_dict_names():
    m = Toy()
    keys = list(m.state_dict())
    mgr = manager_for([m])
    assert "forward" in m.__dict__
    assert list(m.state_dict()) == keys
    mgr.restore()
    assert "forward" not in m.__dict__
    assert m.forward.__func__ is Toy.forward
    assert mgr.stats()["graph_sets"] == 0


def test_restore_keeps_an_earlier_instance_forward():
    m = Toy()

    def custom(*a, **k):
        return Toy.forward(m, *a, **k)

    m.forward = custom
    mgr = manager_for([m])
    mgr.restore()
    assert m.forward is custom


def test_no_grad_and_eval_run_eagerly():
    torch.manual_seed(13)
    m = Toy()
    mgr = manager_for([m])
    mgr.step_begin(0)
    x = torch.randn(4, 8)
    with torch.no_grad():
        m(x)
    m.eval()
    m(x)
    m.train()
    s = mgr.stats()
    assert s["eager_fallbacks"] == {"no_grad": 1, "eval": 1} and s["captures"] == 0


def test_unsupported_argument_runs_eagerly():
    class Params:  # an object that may hold tensors (PackedSeqParams is known: tree.DATACLASSES)
        pass

    class Takes(Toy):
        def forward(self, hidden_states, packed_seq_params=None):
            return super().forward(hidden_states)

    m = Takes()
    mgr = manager_for([m])
    mgr.step_begin(0)
    m(torch.randn(4, 8), packed_seq_params=Params())
    m(torch.randn(4, 8), packed_seq_params=None)
    s = mgr.stats()
    assert s["eager_fallbacks"] == {"unsupported_arg": 1} and s["captures"] == 1


def test_leaked_slot_freed_at_step_begin():
    m = Toy()
    mgr = manager_for([m], max_slots=1)
    mgr.step_begin(0)
    m(torch.randn(4, 8))  # output requires grad (params) but is never differentiated
    mgr.step_begin(1)
    leaf_loss(m(torch.randn(4, 8))).backward()
    s = mgr.stats()
    assert s["leaked_slots"] == 1 and s["slots"] == 1 and "slots_exhausted" not in s["eager_fallbacks"]


def test_capture_after_eager_use_and_dropout_same_rng():
    """A layer that already ran eagerly is captured later; with dropout on, seeding before
    eager and before graphed gives the same masks (warm-up and capture must not consume
    random numbers)."""
    torch.manual_seed(14)
    eager = Toy(dropout=0.5)
    graphed = copy.deepcopy(eager)
    x = torch.randn(4, 8)
    graphed(x)  # eager use before the manager exists
    mgr = manager_for([graphed], capture_warmup_iters=2)
    for step in range(3):
        mgr.step_begin(step)
        torch.manual_seed(100 + step)
        y = graphed(x)[0]
        torch.manual_seed(100 + step)
        ye = eager(x)[0]
        torch.testing.assert_close(y, ye, rtol=0, atol=0)
        (y ** 2).sum().backward()
        (ye ** 2).sum().backward()
    assert_grads_equal(graphed, eager)
    assert mgr.stats()["captures"] == 1


def test_autocast_region():
    torch.manual_seed(15)
    eager = Toy()
    graphed = copy.deepcopy(eager)
    mgr = manager_for([graphed])
    mgr.step_begin(0)
    x = torch.randn(4, 8)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = graphed(x)[0]
            ye = eager(x)[0]
        assert y.dtype == ye.dtype
        torch.testing.assert_close(y, ye)
        (y.float() ** 2).sum().backward()
        (ye.float() ** 2).sum().backward()
    assert_grads_equal(graphed, eager)
    # the same layer outside autocast is another key
    graphed(x)
    assert mgr.stats()["graph_sets"] == 2


def test_fused_wgrad_side_effects_restored_and_recorded():
    """TE's fused wgrad accumulation writes main_grad in backward and sets
    grad_added_to_main_grad; warm-up/capture must leave main_grad untouched, and the
    flag must be re-set on every replay (megatron DDP resets it each step)."""

    class FusedLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))

        def forward(self, x, context=None):
            return _FusedMM.apply(x, self.weight), None

    class _FusedMM(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            w.main_grad.add_(g.t() @ x + 1.0)  # +1: make an unrestored warm-up visible
            w.grad_added_to_main_grad = True
            return g @ w, torch.zeros_like(w)

    def ddp_hook(p):
        if not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad)
        p.grad = None

    torch.manual_seed(16)
    eager = FusedLinear()
    graphed = copy.deepcopy(eager)
    for m in (eager, graphed):
        m.weight.main_grad = torch.zeros(8, 8)
        m.weight.grad_added_to_main_grad = False
        m.weight.register_post_accumulate_grad_hook(ddp_hook)
    mgr = manager_for([graphed], capture_warmup_iters=2)
    for step in range(2):
        mgr.step_begin(step)
        for m in (eager, graphed):
            m.weight.grad_added_to_main_grad = False  # DDP.zero_grad_buffer()
        for _ in range(2):
            x = torch.randn(4, 8)
            y = graphed(x)[0]
            # replay re-does the Python side effect of the captured backward (a CUDA graph
            # would not run it); the rerun backend would, so check it before backward
            assert graphed.weight.grad_added_to_main_grad is True
            (y ** 2).sum().backward()
            (eager(x)[0] ** 2).sum().backward()
    torch.testing.assert_close(graphed.weight.main_grad, eager.weight.main_grad)
    slot = mgr.layers[0].callable.sets[next(iter(mgr.layers[0].callable.sets))][0]
    assert slot.fused == [graphed.weight]


# ----------------------------------------------------------------------------------------------
# megatron TransformerLayer on CPU (local ViT spec, bidirectional)


class _NullTracker:
    states_: dict = {}

    def fork(self, name=None):
        return contextlib.nullcontext()


@pytest.fixture(scope="module")
def megatron_cpu():
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.utils as mutils

    made_pg = made_mp = False
    if not dist.is_initialized():
        tmp = tempfile.mkdtemp()
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        made_pg = True
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
        made_mp = True
    mp = pytest.MonkeyPatch()
    if not torch.cuda.is_available():
        # megatron-core 0.16.1 allocates its attention scratch buffer on CUDA, and its RNG
        # tracker needs CUDA; a CPU buffer and a no-op tracker are enough here
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(tensor_shape, dtype=dtype)

        mp.setattr(mutils.GlobalMemoryBuffer, "get_tensor", get_tensor)
        if not getattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
            mp.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", _NullTracker())
            mp.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    yield
    mp.undo()
    if made_mp:
        ps.destroy_model_parallel()
    if made_pg:
        dist.destroy_process_group()


def _megatron_block(num_layers=2, hidden=32, dropout=0.1):
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=num_layers, hidden_size=hidden, num_attention_heads=4,
                            use_cpu_initialization=True, hidden_dropout=dropout, attention_dropout=0.0,
                            bias_dropout_fusion=False, cuda_graph_scope=[])
    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask  # a ViT
    return TransformerBlock(config=cfg, spec=spec, post_layer_norm=False)


def test_megatron_transformer_layers_on_cpu(megatron_cpu):
    torch.manual_seed(17)
    eager = _megatron_block()
    graphed = _megatron_block()  # megatron modules hold process groups: no deepcopy
    graphed.load_state_dict(eager.state_dict())
    _main_grad_hooks(eager)
    _main_grad_hooks(graphed)
    mgr = GraphManager.for_model([graphed], {"enabled": True, "warmup_steps": 1, "capture_warmup_iters": 1},
                                 backend=RerunBackend())
    assert len(mgr.layers) == 2
    for step in range(3):
        mgr.step_begin(step)
        xs = [torch.randn(6, 2, 32) for _ in range(2)]
        outs, outs_e = [], []
        for i, x in enumerate(xs):  # two microbatches in flight
            torch.manual_seed(1000 * step + i)
            outs.append(graphed(hidden_states=x, attention_mask=None))
            torch.manual_seed(1000 * step + i)
            outs_e.append(eager(hidden_states=x, attention_mask=None))
            torch.testing.assert_close(outs[-1], outs_e[-1], rtol=0, atol=0)
        for y, ye in zip(reversed(outs), reversed(outs_e)):
            (y ** 2).sum().backward()
            (ye ** 2).sum().backward()
    assert_grads_equal(graphed, eager, attr="main_grad")
    s = mgr.stats()
    assert s["captures"] == 4 and s["slots"] == 4 and s["eager_fallbacks"] == {"warmup": 4}
    mgr.restore()
    assert all("forward" not in layer.__dict__ for layer in graphed.layers)


# ----------------------------------------------------------------------------------------------
# impl: te bookkeeping, with a stand-in for TE's make_graphed_callables


def _fake_te(signature="new"):
    """Behaves like TE's make_graphed_callables as far as vitgraph can tell: tensors-only
    positional args, tensors-only outputs (old TE crashed on None), patches module.forward
    and returns the module. Runs eagerly."""
    calls = []

    def check(obj, what):
        leaves = obj if isinstance(obj, (tuple, list)) else (obj,)
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"TE graphs take and return tensors only; {what} had {type(x).__name__}")

    def mgc_new(modules, sample_args, num_warmup_iters=3, allow_unused_input=False, sample_kwargs=None,
                enabled=None, recipe=None, amax_reduction_group=None, pool=None,
                retain_graph_in_backward=False, clone_param_grads_on_return=True):
        return impl(modules, sample_args, locals())

    def mgc_old(modules, sample_args, num_warmup_iters=3, allow_unused_input=False, sample_kwargs=None,
                fp8_enabled=False, fp8_recipe=None, fp8_group=None, pool=None, retain_graph_in_backward=False):
        return impl(modules, sample_args, locals())

    def impl(module, sample_args, kw):
        calls.append({k: v for k, v in kw.items() if k not in ("modules", "sample_args")})
        check(sample_args, "sample_args")
        for _ in range(kw["num_warmup_iters"] + 1):
            check(module(*sample_args), "output")
        orig = module.forward
        params = tuple(p for p in module.parameters() if p.requires_grad)
        static: dict = {}  # like TE's static grad buffers, returned detached (aliasing)

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, n, *tensors):
                with torch.enable_grad():
                    ins = [t.detach().requires_grad_(t.requires_grad) for t in tensors[:n]]
                    out = orig(*ins)
                check(out, "output")
                ctx.ins, ctx.out = ins, out
                return tuple(o.detach() for o in out)

            @staticmethod
            def backward(ctx, *grads):
                pairs = [(o, g if g is not None else torch.zeros_like(o))
                         for o, g in zip(ctx.out, grads) if o.requires_grad]
                diff = [i for i in ctx.ins if i.requires_grad] + list(params)
                res = torch.autograd.grad([o for o, _ in pairs], diff, [g for _, g in pairs], allow_unused=True)
                it = iter(range(len(res)))
                ret = [None]
                for t in list(ctx.ins) + list(params):
                    if not t.requires_grad:
                        ret.append(None)
                        continue
                    k = next(it)
                    if res[k] is None:
                        ret.append(None)
                    else:
                        buf = static.setdefault(k, torch.empty_like(res[k]))
                        buf.copy_(res[k])
                        ret.append(buf.detach())
                return tuple(ret)

        def graphed(*args):
            check(args, "args")
            return Graphed.apply(len(args), *args, *params)

        module.forward = graphed
        return module

    mgc = mgc_new if signature == "new" else mgc_old
    mgc.calls = calls
    return mgc


@pytest.mark.parametrize("signature", ["new", "old"])
@pytest.mark.parametrize("kind", ["tuple", "dict", "nested"])
def test_te_impl_strips_and_reinserts_non_tensors(signature, kind):
    torch.manual_seed(18)
    eager = Toy(kind=kind)
    graphed = copy.deepcopy(eager)
    fake = _fake_te(signature)
    mgr = GraphManager(GraphsConfig(enabled=True, impl="te", warmup_steps=0), [graphed],
                       backend=RerunBackend(), te_make_graphed_callables=fake).apply()
    mgr.step_begin(0)
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    xes = [x.detach().clone().requires_grad_() for x in xs]
    outs, outs_e = {}, {}
    for op in ["F0", "F1", "B0", "F2", "B1", "B2"]:
        i = int(op[1])
        if op[0] == "F":
            outs[i] = graphed(xs[i], context=None, flag=False)
            outs_e[i] = eager(xes[i], context=None, flag=False)
            assert_same_tree(outs[i], outs_e[i])
        else:
            leaf_loss(outs[i]).backward()
            leaf_loss(outs_e[i]).backward()
    for x, xe in zip(xs, xes):
        torch.testing.assert_close(x.grad, xe.grad)
    assert_grads_equal(graphed, eager)
    assert mgr.stats()["slots"] == 2 and len(fake.calls) == 2
    call = fake.calls[0]
    assert call["allow_unused_input"] is True and call["num_warmup_iters"] >= 1
    if signature == "new":
        assert call["enabled"] is False and call["clone_param_grads_on_return"] is False
    else:
        assert call["fp8_enabled"] is False


def test_te_kwargs_follow_signature():
    def only_old(modules, sample_args, fp8_enabled=None, fp8_recipe=None, pool=None):
        pass

    kw = _kwargs_for(only_old, warmup_iters=2, pool="P", fp8=False)
    assert kw == {"fp8_enabled": False, "pool": "P"}


# ----------------------------------------------------------------------------------------------
# cuDNN report


def test_decode_cudnn_version():
    assert gcudnn.decode_cudnn_version(91900) == (9, 19, 0)
    assert gcudnn.decode_cudnn_version(91501) == (9, 15, 1)
    assert gcudnn.decode_cudnn_version(8907) == (8, 9, 7)
    assert gcudnn.decode_cudnn_version(None) is None


@pytest.mark.parametrize("te_version,warns", [((9, 15, 0), True), ((9, 10, 2), True), ((9, 19, 0), False),
                                              (None, False)])
def test_warn_if_fallback(monkeypatch, caplog, te_version, warns):
    monkeypatch.setattr(gcudnn, "te_cudnn_version", lambda: te_version)
    monkeypatch.setattr(gcudnn, "torch_cudnn_version", lambda: (9, 19, 0))
    monkeypatch.setattr(gcudnn, "torch_cudnn_dir", lambda: "/site/nvidia/cudnn")
    with caplog.at_level(logging.INFO, logger="vitgraph.graphs"):
        assert gcudnn.warn_if_fallback(logging.getLogger("vitgraph.graphs")) is warns
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warnings) is warns
    if warns:
        assert "CUDNN_HOME=/site/nvidia/cudnn" in warnings[0].getMessage()
    report = gcudnn.attention_report()
    assert set(report) >= {"torch_cudnn", "te_cudnn", "te_fused_attention_in_graphs", "te_attention_backend"}


def test_refuses_ddp_built_on_the_default_stream():
    """On a GPU, megatron DDP made on the legacy default stream cannot be captured; the
    manager refuses before capturing, naming the fix (faked here: a backend that reports
    the default stream, a module named like megatron's DDP)."""

    class DefaultStreamRerun(RerunBackend):
        def on_default_stream(self):
            return True

    class FakeTransformerLayer(Toy):
        pass

    class DistributedDataParallel(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module
            self.grad_accs = []

    model = DistributedDataParallel(nn.Sequential(FakeTransformerLayer()))
    mgr = GraphManager.for_model([model], {"enabled": True, "warmup_steps": 0}, backend=DefaultStreamRerun())
    assert len(mgr.layers) == 1
    mgr.step_begin(0)
    with pytest.raises(RuntimeError, match="use_side_stream"):
        model.module(torch.randn(4, 8))
    assert mgr.stats()["captures"] == 0


def test_use_side_stream_is_a_no_op_without_cuda():
    from vitgraph.graphs import use_side_stream

    if not torch.cuda.is_available():
        assert use_side_stream() is None


def test_for_model_disabled_is_inert():
    m = nn.Sequential(Toy())
    mgr = GraphManager.for_model(m, {"enabled": False})
    assert "forward" not in m[0].__dict__
    mgr.step_begin(0)
    mgr.reset()
    mgr.restore()
    assert mgr.stats()["enabled"] is False


# ---------------------------------------------------------------- graphs.scope: step

def _step_graphs(**cfg):
    from vitgraph.graphs import RerunBackend, StepGraphs
    return StepGraphs(GraphsConfig(enabled=True, scope="step", **cfg), backend=RerunBackend())


def test_step_graphs_warm_up_capture_and_replay_with_new_inputs():
    """Eager for warmup_steps, then one capture; every later step copies its inputs into the
    static buffers, runs the body's work once and returns this step's results."""
    sg = _step_graphs(warmup_steps=2)
    w = torch.zeros(())
    calls = []

    def body(inputs):
        calls.append(1)
        w.add_(inputs[0][0].sum())  # a side effect, as an optimizer update
        return [inputs[0][0] * 2, w.clone()]

    for step in range(5):
        sg.step_begin(step)
        out = sg.run([(torch.full((3,), float(step)),)], body)
        assert torch.equal(out[0], torch.full((3,), 2.0 * step))
    # each step's work ran exactly once (the rerun backend's capture is the step itself)
    assert len(calls) == 5 and w.item() == 3 * (0 + 1 + 2 + 3 + 4)
    s = sg.stats()
    assert (s["graphs"], s["captures"], s["replays"], s["eager_fallbacks"]["eager_steps"]) == (1, 1, 3, 2)


@pytest.mark.parametrize("policy", ["capture", "eager"])
def test_step_graphs_new_shape_policy(policy):
    sg = _step_graphs(warmup_steps=0, on_new_shape=policy)
    body = lambda inputs: [inputs[0][0] + 1]  # noqa: E731
    for n in (4, 4, 6, 6):
        sg.step_begin()
        assert torch.equal(sg.run([(torch.zeros(n),)], body)[0], torch.ones(n))
    s = sg.stats()
    assert s["graphs"] == (2 if policy == "capture" else 1)
    assert s["unseen_shapes"] == (0 if policy == "capture" else 1)


def test_step_graphs_reset_warms_up_and_captures_again():
    sg = _step_graphs(warmup_steps=1)
    body = lambda inputs: [inputs[0][0] * 3]  # noqa: E731
    for _ in range(3):
        sg.step_begin()
        sg.run([(torch.ones(2),)], body)
    assert sg.active and sg.stats()["captures"] == 1
    sg.reset()
    assert not sg.active
    sg.step_begin()
    sg.run([(torch.ones(2),)], body)  # warm-up again: eager
    assert not sg.active
    sg.step_begin()
    sg.run([(torch.ones(2),)], body)
    s = sg.stats()
    assert sg.active and s["captures"] == 2 and s["recaptures"]["reset"] == 1


def test_only_hooks_not_marked_graph_safe_are_warned_of(caplog):
    """A forward hook's Python runs at capture only: warned of, unless the hook says it only
    makes tensors from tensors (``graph_safe``), as vitgraph's packed attention's does."""
    def safe(module, args, out):
        return out * 2
    safe.graph_safe = True
    warned = []
    for hooks in ([safe], [safe, lambda module, args, out: out]):
        layer = Toy()
        for h in hooks:
            layer.lin2.register_forward_hook(h)
        mgr = manager_for([layer])
        mgr.step_begin(0)
        with caplog.at_level(logging.WARNING, logger=gmanager.log.name):
            caplog.clear()
            leaf_loss(layer(torch.randn(4, 8))).backward()
        assert mgr.stats()["captures"] == 1
        warned.append("hooks inside a graphed layer" in caplog.text)
    assert warned == [False, True]
