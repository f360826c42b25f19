"""tandem.optim.Adagrad against torch.optim.Adagrad, the reference we did not write.

Trajectories use the flash-attention rule: against a float64 run of torch.optim.Adagrad, our float32 error
is at most twice torch's own float32 error (``foreach=False``, torch's default on CPU) plus a small atol.
"""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import re
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

import tandem
from tandem.optim import Adagrad

SHAPES = [(), (7,), (5, 3), (33, 17)]  # 0-d included

OPTIONS = [
    pytest.param({}, id="defaults"),
    pytest.param({"lr_decay": 0.05}, id="lr_decay"),
    pytest.param({"weight_decay": 0.1}, id="weight_decay"),
    pytest.param({"initial_accumulator_value": 0.5}, id="initial_accumulator_value"),
    pytest.param({"eps": 1e-3}, id="eps"),
    pytest.param({"maximize": True}, id="maximize"),
    pytest.param(
        {
            "lr": 0.05,
            "lr_decay": 0.01,
            "weight_decay": 0.02,
            "initial_accumulator_value": 0.1,
            "eps": 1e-6,
            "maximize": True,
        },
        id="all-options",
    ),  # fmt: skip
]


def _init(shapes=SHAPES, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def _noise(steps, shapes=SHAPES, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(steps)]


def _run(make_opt, init, noise, dtype, start=0, stop=None, params=None, opt=None):
    """Train ``params`` with gradients ``noise[t] + 0.1 p`` (a gradient that depends on the parameters)."""
    if params is None:
        params = [torch.nn.Parameter(x.to(dtype).clone()) for x in init]
    if opt is None:
        opt = make_opt(params)
    for t in range(start, len(noise) if stop is None else stop):
        for p, n in zip(params, noise[t]):
            p.grad = (n.to(dtype) + 0.1 * p.detach()).to(dtype)
        opt.step()
    return params, opt


def _max_err(xs, refs):
    return max((x.detach().double() - r.detach().double()).abs().max().item() for x, r in zip(xs, refs))


def _assert_flash_rule(ours, theirs, ref, atol):
    err_ours, err_theirs = _max_err(ours, ref), _max_err(theirs, ref)
    assert err_ours <= 2 * err_theirs + atol, f"tandem error {err_ours:.3g} vs torch {err_theirs:.3g}"


@pytest.mark.parametrize("options", OPTIONS)
def test_trajectory_matches_torch(options):
    steps = 300
    init, noise = _init(), _noise(steps)
    ref, _ = _run(lambda ps: torch.optim.Adagrad(ps, foreach=False, **options), init, noise, torch.float64)
    theirs, t_opt = _run(
        lambda ps: torch.optim.Adagrad(ps, foreach=False, **options), init, noise, torch.float32
    )
    ours, o_opt = _run(lambda ps: Adagrad(ps, **options), init, noise, torch.float32)
    _assert_flash_rule(ours, theirs, ref, atol=1e-6)
    torch.testing.assert_close([p.detach() for p in ours], [p.detach() for p in theirs], rtol=1e-5, atol=1e-5)
    sums = [o_opt.state[p]["sum"] for p in ours]
    torch.testing.assert_close(sums, [t_opt.state[p]["sum"] for p in theirs], rtol=1e-5, atol=1e-5)
    assert all(o_opt.state[p]["step"].item() == steps for p in ours)


@pytest.mark.parametrize(
    ("dtype", "atol"),
    [
        pytest.param(torch.float64, 1e-12, id="float64"),
        pytest.param(torch.bfloat16, 1e-2, id="bfloat16"),
        pytest.param(torch.float16, 1e-3, id="float16"),
    ],
)
def test_trajectory_other_dtypes(dtype, atol):
    steps = 60
    options = {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.02, "maximize": True}
    init, noise = _init(), _noise(steps)
    ref, _ = _run(lambda ps: torch.optim.Adagrad(ps, foreach=False, **options), init, noise, torch.float64)
    theirs, _ = _run(lambda ps: torch.optim.Adagrad(ps, foreach=False, **options), init, noise, dtype)
    ours, _ = _run(lambda ps: Adagrad(ps, **options), init, noise, dtype)
    assert all(p.dtype == dtype for p in ours)
    _assert_flash_rule(ours, theirs, ref, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_dtypes_are_torchs_default_bit_for_bit(dtype):
    """torch's CPU default is its per-tensor update (foreach only defaults for CUDA tensors), whose
    addcdiv_ takes -clr unrounded: the same numbers to the bit over many steps, lr_decay included."""
    options = {"lr": 0.05, "lr_decay": 1e-3, "weight_decay": 0.02, "maximize": True}
    init, noise = _init(), _noise(100)
    theirs, _ = _run(lambda ps: torch.optim.Adagrad(ps, **options), init, noise, dtype)
    ours, _ = _run(lambda ps: Adagrad(ps, **options), init, noise, dtype)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_complex_parameters_match_torch():
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen, dtype=torch.complex64) for s in [(), (4,), (3, 5)]]
    ps_a = [torch.nn.Parameter(x.clone()) for x in init]
    ps_b = [torch.nn.Parameter(x.clone()) for x in init]
    options = {"lr": 0.1, "weight_decay": 0.05, "maximize": True, "initial_accumulator_value": 0.2}
    ours, theirs = Adagrad(ps_a, **options), torch.optim.Adagrad(ps_b, foreach=False, **options)
    for _ in range(50):
        for a, b in zip(ps_a, ps_b):
            g = torch.randn(a.shape, generator=gen, dtype=torch.complex64)
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close([p.detach() for p in ps_a], [p.detach() for p in ps_b], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close([ours.state[p]["sum"] for p in ps_a], [theirs.state[p]["sum"] for p in ps_b])


@pytest.mark.parametrize(
    "receiver",
    [
        pytest.param({"foreach": False}, id="into-torch-forloop"),
        pytest.param({"fused": True}, id="into-torch-fused"),
        pytest.param({"foreach": True}, id="into-torch-foreach"),
    ],
)
def test_state_dict_exchange_mid_training(receiver):
    """Ours -> torch and torch -> ours after 40 steps; both end where an uninterrupted torch run ends."""
    steps, half = 80, 40
    options = {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.02, "initial_accumulator_value": 0.1}
    init, noise = _init(), _noise(steps)
    ref, _ = _run(lambda ps: torch.optim.Adagrad(ps, foreach=False, **options), init, noise, torch.float32)

    # ours for 40 steps, then torch for 40 from our state_dict (through torch.save, as a checkpoint would)
    ps, ours = _run(lambda ps: Adagrad(ps, **options), init, noise, torch.float32, stop=half)
    sd = ours.state_dict()
    assert set(sd["state"][0]) == {"sum", "step"} and torch.is_tensor(sd["state"][0]["step"])
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    theirs = torch.optim.Adagrad(ps, **receiver)
    theirs.load_state_dict(torch.load(buf))
    ps, _ = _run(None, init, noise, torch.float32, start=half, params=ps, opt=theirs)
    torch.testing.assert_close([p.detach() for p in ps], [p.detach() for p in ref], rtol=1e-5, atol=1e-5)

    # torch for 40 steps, then ours from torch's state_dict
    ps, theirs = _run(
        lambda ps: torch.optim.Adagrad(ps, **receiver, **options), init, noise, torch.float32, stop=half
    )
    ours = Adagrad(ps, tol=1e-3)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert ours.param_groups[0]["lr_decay"] == options["lr_decay"]
    assert all(ours.state[p]["step"].dtype == torch.float32 for p in ps)
    ps, _ = _run(None, init, noise, torch.float32, start=half, params=ps, opt=ours)
    torch.testing.assert_close([p.detach() for p in ps], [p.detach() for p in ref], rtol=1e-5, atol=1e-5)
    assert all(ours.state[p]["step"].item() == steps for p in ps)


def test_state_dict_with_float64_default_dtype_step():
    """torch's for-loop path keeps ``step`` in float64 under a float64 default dtype; we load float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        p = torch.nn.Parameter(torch.randn(3, dtype=torch.float32))
        theirs = torch.optim.Adagrad([p], foreach=False)
        p.grad = torch.ones(3, dtype=torch.float32)
        theirs.step()
        assert theirs.state[p]["step"].dtype == torch.float64
        ours = Adagrad([p])
        ours.load_state_dict(theirs.state_dict())
    finally:
        torch.set_default_dtype(previous)
    assert ours.state[p]["step"].dtype == torch.float32 and ours.state[p]["step"].item() == 1
    ours.step()
    assert ours.state[p]["step"].item() == 2


def test_state_dict_with_wrong_sum_shape_raises_before_any_change():
    p = torch.nn.Parameter(torch.randn(4))
    sd = copy.deepcopy(Adagrad([p]).state_dict())
    sd["state"][0]["sum"] = torch.zeros(5)
    sd["param_groups"][0]["lr"] = 0.5
    opt = Adagrad([p], initial_accumulator_value=0.1)
    with pytest.raises(ValueError, match=r"state\['sum'\] of the shape of its parameter \(4,\), got \(5,\)"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 1e-2 and torch.equal(opt.state[p]["sum"], torch.full((4,), 0.1))


def test_state_exists_from_construction_like_torch():
    p = torch.nn.Parameter(torch.randn(2, 3))
    ours, theirs = (
        Adagrad([p], initial_accumulator_value=0.25),
        torch.optim.Adagrad([p], initial_accumulator_value=0.25),
    )
    assert set(ours.state[p]) == set(theirs.state[p]) == {"sum", "step"}
    torch.testing.assert_close(ours.state[p]["sum"], theirs.state[p]["sum"])
    assert ours.state[p]["step"].item() == 0 and ours.state[p]["step"].device == p.device


def _quadratic(shapes=((), (5,), (4, 3))):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    targets = [torch.randn(s, generator=gen) for s in shapes]
    weights = [torch.rand(s, generator=gen) + 0.5 for s in shapes]

    def set_grads():
        for p, c, a in zip(params, targets, weights):
            p.grad = a * (p.detach() - c)  # gradient of 0.5 * a * (p - c)^2

    return params, set_grads


def test_converged_flag_on_a_quadratic():
    tol = 1e-4
    params, set_grads = _quadratic()
    opt = Adagrad(params, lr=0.5, tol=tol)
    assert opt.converged.dtype == torch.bool and opt.converged.shape == () and not opt.converged
    flags = []
    for _ in range(2000):
        set_grads()
        before = [p.detach().clone() for p in params]
        opt.step()
        change = max((p.detach() - b).abs().max() for p, b in zip(params, before))
        assert torch.is_tensor(opt.converged) and opt.converged.device == params[0].device
        assert opt.max_change.dtype == torch.float32
        assert opt.max_change.item() == change.item()  # the same float32 subtractions
        assert bool(opt.converged) == (change.item() <= tol)
        flags.append(bool(opt.converged))
        if flags[-1]:
            break
    assert flags[-1], "Adagrad should converge on a quadratic within 2000 steps"
    assert not flags[0]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_converged_and_max_change_of_a_compiled_step(backend):
    """torch.compile(opt.step): dynamo drops a compiled step's assignments to the optimizer's attributes,
    so max_change stayed inf and converged False at every step (a loop waiting for it never ended). Each
    step's values, as the uncompiled step's; after load_state_dict, as before any step."""
    tol = 1e-3
    runs = []
    for compiled in (False, True):
        torch.compiler.reset()
        p = torch.nn.Parameter(torch.linspace(-1, 1, 5))
        opt = Adagrad([p], lr=0.1, tol=tol)
        step = torch.compile(opt.step, backend=backend) if compiled else opt.step
        seen = []
        for lr in (0.1, 1e-4):
            opt.param_groups[0]["lr"] = lr
            p.grad = torch.ones(5)
            step()
            seen.append((opt.max_change.item(), bool(opt.converged)))
        opt.load_state_dict(opt.state_dict())
        seen.append((opt.max_change.item(), bool(opt.converged)))
        runs.append(seen)
    plain, compiled = runs
    assert [c for _, c in plain] == [False, True, False] and plain[2][0] == float("inf")
    assert [c for _, c in compiled] == [c for _, c in plain]
    for (got, _), (want, _) in zip(compiled[:2], plain[:2]):
        assert got == pytest.approx(want, rel=1e-3)
    assert compiled[2][0] == float("inf")


@pytest.mark.parametrize("options", [{}, {"lr_decay": 0.05, "tol": 1e-3}], ids=["defaults", "lr_decay-tol"])
def test_a_compiled_step_follows_a_scheduler_tensor_lr_without_recompiling(options):
    """torch's recipe for a compiled optimizer with an LR scheduler: lr as a tensor, which the scheduler
    changes in place. torch's compiled step follows it with the graphs of its first steps; tandem's read
    the tensor while tracing, recompiled at every new lr and gave up at dynamo's recompile limit (8), with
    a warning, running eagerly from there. Trajectories against torch's eager Adagrad with the same
    scheduler, and the graphs dynamo made after the third step: none."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    init = _init([(5, 3), (4,)], dtype=torch.float32)
    noise = _noise(12, [(5, 3), (4,)])
    tol = options.pop("tol", None)
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    theirs = [torch.nn.Parameter(x.clone()) for x in init]
    opt = Adagrad(ours, lr=torch.tensor(0.1), tol=tol, **options)
    ref = torch.optim.Adagrad(theirs, lr=torch.tensor(0.1), **options)
    schedulers = [torch.optim.lr_scheduler.ExponentialLR(o, 0.7) for o in (opt, ref)]
    step = torch.compile(opt.step, backend=counting)
    for t, g in enumerate(noise):
        if t == 3:
            warm = len(graphs)
        for p, q, n in zip(ours, theirs, g):
            p.grad, q.grad = n.float() + 0.1 * p.detach(), n.float() + 0.1 * q.detach()
        step()
        ref.step()
        for s in schedulers:
            s.step()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)
    assert warm > 0 and len(graphs) == warm
    ours_lr, their_lr = opt.param_groups[0]["lr"], ref.param_groups[0]["lr"]
    assert ours_lr is not their_lr and ours_lr.item() == their_lr.item() == pytest.approx(0.1 * 0.7**12)


@pytest.mark.parametrize(
    "lr, lr_decay",
    [
        (lambda: torch.tensor(0.1), lambda: torch.tensor(0.05)),
        (lambda: 0.1, lambda: torch.tensor(0.05)),
        (lambda: torch.tensor(0.1), lambda: np.float32(0.05)),
        (lambda: torch.tensor(complex(0.1, 0)), lambda: 0.05),
    ],
    ids=["tensors", "tensor-lr_decay", "numpy-lr_decay", "complex-lr"],
)
def test_a_compiled_step_takes_an_lr_and_lr_decay_of_other_types_as_torchs(lr, lr_decay):
    """Eager, these send the step the per-tensor way (torch's decayed rate in their dtype); compiled, the
    kernels take them as numbers, as before: the per-tensor way handed a tensor lr_decay to the op (a float
    argument), and float() to a complex lr, and the compile failed. torch's compiled steps: last bits."""
    torch.compiler.reset()
    steps = []
    for cls in (Adagrad, torch.optim.Adagrad):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 4))
        opt = cls([p], lr=0.1)
        opt.param_groups[0].update(lr=lr(), lr_decay=lr_decay())
        step = torch.compile(opt.step, backend="eager")
        for t in range(3):
            p.grad = torch.cos(p.detach() * (t + 1))
            step()
        steps.append(p.detach())
    torch.testing.assert_close(steps[0], steps[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_converged_compares_the_change_with_tol_itself(dtype):
    """A first step of lr 0.1 moves each element by float32(0.1) = 0.10000000149 > 0.1: tol=0.1 was met
    (tol rounded to float32 in the comparison); tol = that change is met."""
    for tol, expected in ((0.1, False), (float(torch.tensor(0.1)), True)):
        p = torch.zeros(3, dtype=dtype, requires_grad=True)
        opt = Adagrad([p], lr=float(torch.tensor(0.1)), tol=tol)
        p.grad = torch.ones(3, dtype=dtype)
        opt.step()
        assert opt.max_change.item() == float(torch.tensor(0.1))
        assert bool(opt.converged) is expected, (tol, dtype)


@pytest.mark.parametrize("default_dtype", [torch.float16, torch.float64], ids=["f16", "f64"])
def test_tol_under_another_default_device_and_dtype(default_dtype):
    """A CPU model's step with ``tol`` where another device is the default (``torch.set_default_device``,
    the ``torch.device`` context; "meta" stands in for a GPU) computes as torch's fused Adagrad does there:
    the tracked step made its scratch on the default device and raised. An optimizer made under another
    default dtype keeps ``max_change`` in float32: a float16 one rounded every change it held."""
    gen = torch.Generator().manual_seed(0)
    init, grads = torch.randn(2, 33, 17, generator=gen)
    ps = [torch.nn.Parameter(init.clone()) for _ in range(2)]
    saved = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        ours = Adagrad([ps[1]], lr=0.1, tol=1e-3)
    finally:
        torch.set_default_dtype(saved)
    theirs = torch.optim.Adagrad([ps[0]], lr=0.1, fused=True)
    for p, opt in zip(ps, (theirs, ours)):
        p.grad = grads.clone()
        with torch.device("meta"):
            opt.step()
    assert torch.equal(ps[1], ps[0])
    change = (ps[1].detach() - init).abs().max()
    assert ours.max_change.dtype == torch.float32 and ours.max_change.item() == change.item()
    assert not ours.converged


def test_a_step_without_gradients_moves_nothing_and_has_converged():
    """No parameter had a gradient (a frozen model, a skipped batch): nothing moved, so the largest change
    is 0 and the test on it is met."""
    p = torch.zeros(3, requires_grad=True)
    opt = Adagrad([p], lr=0.1, tol=1e-6)
    opt.step()
    assert opt.max_change.item() == 0.0 and bool(opt.converged) and torch.equal(p, torch.zeros(3))


def test_max_change_and_converged_cover_every_param_group():
    """With several param groups, max_change is the largest change over all of them, not the last group's:
    here the first group moves most, so a step that looked at the last group alone would call it converged
    (and a loop waiting for it would stop training early). Parameters as torch.optim.Adagrad's."""
    tol = 1e-2
    init = _init(shapes=[(4,), (3,)])
    grads = _noise(1, shapes=[(4,), (3,)])[0]
    groups = lambda a, b: [{"params": [a], "lr": 0.5}, {"params": [b], "lr": 1e-3}]  # noqa: E731
    ours_params = [torch.nn.Parameter(x.float().clone()) for x in init]
    theirs_params = [torch.nn.Parameter(x.float().clone()) for x in init]
    ours = Adagrad(groups(*ours_params), tol=tol)
    theirs = torch.optim.Adagrad(groups(*theirs_params), foreach=False)
    for params in (ours_params, theirs_params):
        for p, g in zip(params, grads):
            p.grad = g.float().clone()
    before = [p.detach().clone() for p in ours_params]
    ours.step()
    theirs.step()
    torch.testing.assert_close(ours_params, theirs_params)
    changes = [(p.detach() - b).abs().max() for p, b in zip(ours_params, before)]
    assert changes[0] > tol >= changes[1]  # the first group's change is the largest, and over tol
    assert ours.max_change.item() == max(c.item() for c in changes)
    assert not bool(ours.converged)


def test_converged_is_computed_without_host_sync(monkeypatch):
    params, set_grads = _quadratic()
    opt = Adagrad(params, lr=0.5, tol=1e-4, weight_decay=0.01)
    set_grads()
    opt.step()  # state already exists; a first step could not sync anyway

    def no_sync(*args, **kwargs):
        raise AssertionError("a host sync (item/bool/float/int/tolist) during step()")

    set_grads()
    for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    opt.step()
    monkeypatch.undo()
    assert opt.converged.dtype == torch.bool


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_converged_is_computed_without_host_sync_cuda():
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in [(), (100,), (30, 7)]]
    opt = Adagrad(params, tol=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
        flag = opt.converged
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert flag.device.type == "cuda" and flag.dtype == torch.bool


def test_converged_needs_tol():
    opt = Adagrad([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(RuntimeError, match="tol is set"):
        opt.converged  # noqa: B018


BAD_ARGS = [
    pytest.param({"lr": -1e-2}, id="lr"),
    pytest.param({"lr": torch.tensor([0.1, 0.2])}, id="lr-tensor-2-elements"),
    pytest.param({"lr_decay": -0.5}, id="lr_decay"),
    pytest.param({"weight_decay": -0.1}, id="weight_decay"),
    pytest.param({"initial_accumulator_value": -1.0}, id="initial_accumulator_value"),
    pytest.param({"eps": -1e-10}, id="eps"),
    pytest.param({"lr": float("nan")}, id="lr-nan"),
]


@pytest.mark.parametrize("kwargs", BAD_ARGS)
def test_bad_hyper_parameters_raise_torchs_error(kwargs):
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError) as theirs:
        torch.optim.Adagrad(params, **kwargs)
    with pytest.raises(ValueError, match=re.escape(str(theirs.value))):
        Adagrad(params, **kwargs)


@pytest.mark.parametrize(
    "tol",
    [-1e-3, float("nan"), "1e-3", True, np.bool_(False), torch.tensor([1e-3, 1e-3]), torch.tensor(-1.0)],
    ids=["negative", "nan", "string", "bool", "numpy-bool", "two-elements", "negative-tensor"],
)
def test_bad_tol_raises(tol):
    with pytest.raises(ValueError, match=r"Invalid tol value: expected None or a real number >= 0, got \S"):
        Adagrad([torch.nn.Parameter(torch.zeros(3))], tol=tol)


@pytest.mark.parametrize("tol", [np.float32(0.25), np.int64(0), torch.tensor(0.25), Fraction(1, 4)], ids=str)
def test_tol_of_other_number_types_is_taken_as_a_float(tol):
    opt = Adagrad([torch.nn.Parameter(torch.zeros(3))], tol=tol)
    assert type(opt.tol) is float and opt.tol == float(tol)


@pytest.mark.parametrize(
    "kwargs",
    [{"fused": True, "differentiable": True}, {"fused": True, "foreach": True}],
    ids=["diff", "foreach"],
)
def test_fused_flag_conflicts_raise_like_torch(kwargs):
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(RuntimeError) as theirs:
        torch.optim.Adagrad(params, **kwargs)
    with pytest.raises(RuntimeError, match=re.escape(str(theirs.value))):
        Adagrad(params, **kwargs)


def _torch_makes_state_at_the_step() -> bool:
    """torch 2.13's Adagrad makes a parameter's state at its first step; 2.11's at construction only."""
    return "len(state) == 0" in inspect.getsource(torch.optim.Adagrad._init_group)


def _raised(make) -> tuple[type, str] | None:
    try:
        make()
    except Exception as e:
        return type(e), str(e)
    return None


@pytest.mark.parametrize(
    ("params", "kwargs"),
    [
        ([], {"fused": True, "differentiable": True}),  # the parameters are checked first
        (torch.nn.Parameter(torch.zeros(3)), {"fused": True, "foreach": True}),
        ([torch.nn.Parameter(torch.zeros(3))], {"lr": "0.1"}),  # torch's TypeError of its comparison
        ([torch.nn.Parameter(torch.zeros(3))], {"eps": None}),
    ],
    ids=["empty-fused-differentiable", "tensor-fused-foreach", "lr-string", "eps-none"],
)
def test_constructor_refusals_in_torchs_order(params, kwargs):
    theirs = _raised(lambda: torch.optim.Adagrad(params, **kwargs))
    assert theirs is not None
    assert _raised(lambda: Adagrad(params, **kwargs)) == theirs


def _sparse_grad(p: torch.nn.Parameter) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, p.shape[1]), p.shape)


@pytest.mark.parametrize(
    "case", ["fused-sparse", "fused-complex-second", "foreach-differentiable", "fused-made-differentiable"]
)
def test_step_refusals_as_torch_before_any_change(case):
    """torch's error at step(), and nothing moved (torch may have updated the groups before the one it
    refuses; tandem checks every group first)."""

    def make(cls):
        dense = torch.nn.Parameter(torch.ones(3))
        if case == "fused-sparse":
            odd, kwargs = torch.nn.Parameter(torch.ones(4, 2)), dict(fused=True)
        elif case == "fused-complex-second":
            odd, kwargs = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64)), dict(fused=True)
        elif case == "foreach-differentiable":
            odd, kwargs = torch.nn.Parameter(torch.ones(2)), dict(foreach=True, differentiable=True)
        else:
            odd, kwargs = torch.nn.Parameter(torch.ones(2)), dict(fused=True)
        opt = cls([{"params": [dense], "lr": 0.5}, {"params": [odd]}], **kwargs)
        if case == "fused-made-differentiable":
            opt.param_groups[1]["differentiable"] = True
        dense.grad = torch.ones(3)
        odd.grad = _sparse_grad(odd) if case == "fused-sparse" else torch.ones_like(odd)
        return opt, dense, odd

    opt, *_ = make(torch.optim.Adagrad)
    theirs = _raised(opt.step)
    assert theirs is not None
    opt, dense, odd = make(Adagrad)
    assert _raised(opt.step) == theirs
    assert torch.equal(dense, torch.ones(3)) and torch.equal(odd.detach(), torch.ones_like(odd))
    assert all(opt.state[p]["step"].item() == 0 for p in (dense, odd))
    assert torch.equal(opt.state[dense]["sum"], torch.zeros(3))


@pytest.mark.parametrize(
    ("key", "value", "plain"),
    [
        ("maximize", 1, True),
        ("maximize", np.True_, True),
        ("maximize", torch.tensor(True), True),
        ("maximize", "yes", True),
        ("lr", Fraction(1, 10), 0.1),
        ("lr", np.float64(0.1), 0.1),
        ("lr", np.array(0.1), 0.1),
        ("lr_decay", Fraction(1, 10), 0.1),
        ("lr", complex(0.1, 0), 0.1),
        ("lr", torch.tensor(complex(0.1, 0)), None),
    ],
    ids=[
        "maximize-int", "maximize-numpy", "maximize-tensor", "maximize-string", "lr-fraction", "lr-numpy",
        "lr-numpy-0d", "lr-decay-fraction", "lr-complex-real", "lr-complex-tensor-real",
    ],
)  # fmt: skip
def test_hyperparameters_of_other_types_step_as_torchs_default(key, value, plain):
    """What torch's CPU default (its per-tensor update) takes: a truth value for maximize, numbers that
    Python divides by a float. tandem's kernels take a float and a bool: it reads them the same way."""

    def run(cls, v, **kwargs):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 6))
        opt = cls([p], lr=0.2, lr_decay=0.05, **kwargs)
        opt.param_groups[0][key] = v  # after construction: no constructor check to pass
        for t in range(3):
            p.grad = torch.cos(p.detach() * (t + 1))
            opt.step()
        return p.detach(), opt.state[p]["step"].item()

    expected, steps = run(torch.optim.Adagrad, value)
    got, our_steps = run(Adagrad, value)
    assert our_steps == steps == 3
    if plain is None:  # a complex64 lr: its clr is complex64 arithmetic's, which the per-tensor path takes
        assert torch.equal(got, expected)
        return
    assert torch.equal(got, run(Adagrad, plain)[0])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)  # fused against per-tensor: last bits


@pytest.mark.parametrize(
    ("key", "value"),
    [("lr", Decimal("0.1")), ("eps", Fraction(1, 1000)), ("weight_decay", Fraction(1, 10)), ("lr", "0.1")],
    ids=["decimal-lr", "fraction-eps", "fraction-weight-decay", "string-lr"],
)
def test_hyperparameters_torch_refuses_raise_its_error_before_any_change(key, value):
    def make(cls):
        a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
        opt = cls([{"params": [a]}, {"params": [b]}], lr=0.1)
        opt.param_groups[1][key] = value
        a.grad, b.grad = torch.ones(3), torch.ones(2)
        return opt, a, b

    theirs = _raised(make(torch.optim.Adagrad)[0].step)
    opt, a, b = make(Adagrad)
    assert _raised(opt.step) == theirs and theirs[0] is TypeError
    assert torch.equal(a.detach(), torch.ones(3)) and torch.equal(b.detach(), torch.ones(2))
    assert all(opt.state[p]["step"].item() == 0 for p in (a, b))


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128]
)
@pytest.mark.parametrize(
    "hyper",
    [{"lr": 1e39}, {"lr": 1e5}, {"weight_decay": 1e39}, {"weight_decay": 1e5}, {"eps": 1e39}],
    ids=["lr-1e39", "lr-1e5", "weight-decay-1e39", "weight-decay-1e5", "eps-1e39"],
)
def test_numbers_beyond_a_dtypes_range_step_or_raise_as_torchs_default(dtype, hyper):
    """Whether torch's ops take a number depends on the tensor's dtype: an lr of 1e39 steps a float64
    parameter (to -1e39) and overflows a float32 one's update; a weight decay of 1e5 overflows float16's
    alone. tandem tried them as for float32 whatever the dtype: it refused float64 updates torch makes, and
    named float where torch names c10::Half. What torch refuses, tandem refuses with its error before
    anything changes (torch's update has counted the step by then)."""

    def make(cls):
        a = torch.nn.Parameter(torch.linspace(1, 2, 3, dtype=dtype))
        b = torch.nn.Parameter(torch.linspace(-1, 1, 4, dtype=dtype))
        opt = cls([{"params": [a]}, {"params": [b], **hyper}], lr=0.1)
        a.grad, b.grad = torch.ones_like(a), torch.full_like(b, 0.5)
        return opt, a, b

    theirs, mine = make(torch.optim.Adagrad), make(Adagrad)
    raised = _raised(theirs[0].step)
    assert _raised(mine[0].step) == raised
    if raised is None:
        for got, want in zip(mine[1:], theirs[1:]):  # (the dtype's tolerance: Triton rounds halves once)
            torch.testing.assert_close(got.detach(), want.detach(), equal_nan=True)
    else:
        opt, a, b = mine
        assert torch.equal(a.detach(), torch.linspace(1, 2, 3, dtype=dtype))
        assert all(opt.state[p]["step"].item() == 0 for p in (a, b))


def test_an_lr_that_overflows_at_step_1_and_not_at_the_parameters_step_steps_as_torchs_default():
    """``clr = lr / (1 + (step - 1) * lr_decay)``: an lr of 1e39 set at step 11 with lr_decay 1 moves a
    float32 parameter by 9.1e37, which float32 holds; torch steps, and so does tandem."""

    def run(cls):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 6))
        opt = cls([p], lr=0.1, lr_decay=1.0)
        for t in range(11):
            if t == 10:
                opt.param_groups[0]["lr"] = 1e39
            p.grad = torch.cos(p.detach() * (t + 1))
            opt.step()
        return p.detach()

    got, want = run(Adagrad), run(torch.optim.Adagrad)
    assert got.abs().min() > 1e37
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


_NARROW_NUMBERS = {
    "float16-tensor": lambda: torch.tensor([0.1], dtype=torch.float16),
    "bfloat16-tensor": lambda: torch.tensor([0.1], dtype=torch.bfloat16),
    "float32-tensor": lambda: torch.tensor(0.1),
    "numpy-float32": lambda: np.float32(0.1),
}


@pytest.mark.parametrize("lr", [torch.tensor(0.1), torch.tensor(0.1, dtype=torch.float64)], ids=str)
def test_a_tensor_lr_with_a_negative_lr_decay_divides_by_zero_as_torchs(lr):
    """A tensor lr divided by a denominator of 0 is inf in torch's update (a Python number's division
    raises): the parameters go to -inf, no error, in both."""

    def run(cls):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 4))
        opt = cls([p], lr=0.1)
        opt.param_groups[0].update(lr=lr.clone(), lr_decay=-0.5)  # the denominator is 0 at step 3
        for _ in range(3):
            p.grad = torch.ones(4)
            opt.step()
        return p.detach()

    assert torch.equal(run(Adagrad), run(torch.optim.Adagrad))


@pytest.mark.parametrize("two", [False, True], ids=["one-parameter", "with-a-non-contiguous-one"])
def test_a_negative_lr_decay_whose_rate_divides_by_zero_later_raises_torchs_error_before_any_change(two):
    """An lr_decay of -1 set in param_groups (the constructor refuses it): at step 2 torch's
    ``lr / (1 + (step - 1) * lr_decay)`` divides by zero and raises. tandem tried the numbers at step 1
    only: its fused kernel divided by zero and the parameter went to -inf without an error (and with a
    second parameter on the per-tensor path the error came after the first had moved)."""

    def make(cls):
        ps = [torch.nn.Parameter(torch.linspace(-1, 1, 4))]
        ps += [torch.nn.Parameter(torch.ones(3, 2).t())] if two else []
        opt = cls(ps, lr=0.1)
        opt.param_groups[0]["lr_decay"] = -1.0
        for q in ps:
            q.grad = torch.ones_like(q)
        opt.step()  # step 1: 1 + 0 * lr_decay
        return opt, ps

    opt, _ = make(torch.optim.Adagrad)
    theirs = _raised(opt.step)
    assert theirs == (ZeroDivisionError, "float division by zero")
    opt, ps = make(Adagrad)
    before = [(q.detach().clone(), opt.state[q]["sum"].clone()) for q in ps]
    assert _raised(opt.step) == theirs
    for q, (value, total) in zip(ps, before):
        assert torch.equal(q.detach(), value) and torch.equal(opt.state[q]["sum"], total)
        assert opt.state[q]["step"].item() == 1


@pytest.mark.parametrize("narrow", ["lr", "lr_decay"])
@pytest.mark.parametrize("kind", list(_NARROW_NUMBERS))
@pytest.mark.parametrize("lr_decay", [0.05, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_lr_or_lr_decay_of_a_narrower_dtype_steps_as_torchs_default_to_the_bit(
    narrow, kind, lr_decay, dtype
):
    """torch's per-tensor update divides lr itself, ``lr / (1 + (step - 1) * lr_decay)``, in the
    arithmetic of what it was given: a tensor's or numpy number's dtype rounds its clr. tandem read them as
    floats and divided in float64: with lr_decay, a relative 2e-4 (float16) and 4e-3 (bfloat16) away from
    torch after 4 steps; float32 (a tensor or numpy number, as lr or as lr_decay) ~1e-8 on every element of
    a float64 parameter."""
    hyper = {"lr": 0.1, "lr_decay": lr_decay}
    if narrow == "lr":
        hyper["lr"] = _NARROW_NUMBERS[kind]()
    elif lr_decay != 0:  # (torch's addcdiv_ refuses a clr of one dimension: a 0-d lr_decay)
        number = _NARROW_NUMBERS[kind]() / 2
        hyper["lr_decay"] = number.reshape(()) if isinstance(number, torch.Tensor) else number

    def run(cls):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 6, dtype=dtype))
        q = torch.nn.Parameter(torch.linspace(0, 2, 5, dtype=dtype))
        opt = cls([p, q], **hyper)
        for t in range(4):
            p.grad, q.grad = torch.cos(p.detach() * (t + 1)), torch.sin(q.detach() * (t + 1))
            opt.step()
        return p.detach(), q.detach(), opt.state[p]["sum"]

    for got, want in zip(run(Adagrad), run(torch.optim.Adagrad)):
        if lr_decay == 0 and dtype == torch.float32:  # the fused kernel: its last bits
            torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
        else:
            assert torch.equal(got, want)


def test_a_gradient_of_another_dtype_steps_as_torchs_default():
    """A float64 gradient set through ``.data`` on a float32 parameter (master-weight code): torch's
    per-tensor ops promote it; tandem takes them for that parameter, bit for bit."""

    def run(cls):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 6))
        q = torch.nn.Parameter(torch.linspace(0, 1, 4))
        opt = cls([p, q], lr=0.2, lr_decay=0.05, weight_decay=0.01)
        for t in range(3):
            p.grad = torch.zeros(6)
            p.grad.data = torch.sin(p.detach().double() * (t + 1))
            q.grad = torch.cos(q.detach() * (t + 1))
            opt.step()
        return p.detach(), q.detach(), opt.state[p]["sum"]

    (p_want, q_want, sum_want), (p_got, q_got, sum_got) = run(torch.optim.Adagrad), run(Adagrad)
    assert torch.equal(p_got, p_want) and torch.equal(sum_got, sum_want)
    torch.testing.assert_close(q_got, q_want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_a_model_converted_after_the_optimizer_was_made_steps_as_torchs(dtype):
    """``opt = Adagrad(model.parameters()); model.double()``: the parameters are the same objects, their
    float32 sums stay; torch trains on, promoting per tensor. tandem's fused step read the sums as the
    parameters' dtype (a float64 one read past their end, a crash on the Triton path; garbage sums with
    float16) or refused them (torch's fused CPU kernel): such parameters now take torch's per-tensor math."""

    def run(cls):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = cls(model.parameters(), lr=0.1, lr_decay=0.01, weight_decay=0.01)
        model.to(dtype)
        x = torch.randn(8, 4, dtype=dtype)
        for _ in range(3):
            opt.zero_grad()
            model(x).float().square().sum().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()], [
            opt.state[p]["sum"] for p in model.parameters()
        ]

    (p_want, s_want), (p_got, s_got) = run(torch.optim.Adagrad), run(Adagrad)
    assert all(s.dtype == torch.float32 for s in s_got)
    for got, want in zip(p_got + s_got, p_want + s_want):
        assert torch.equal(got, want)


@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "two-groups"])
def test_a_model_moved_after_the_optimizer_was_made_is_refused_before_any_change(groups):
    """``opt = Adagrad(model.parameters()); model.cuda()``: the sums stay behind. torch's per-tensor ops
    refuse it (a RuntimeError) after updating the parameters before it; tandem's kernels would read the
    sums through the wrong device's addresses. A RuntimeError that says so, nothing changed (in any group:
    the check once ran group by group, after the earlier groups had moved)."""
    model = torch.nn.Linear(3, 2)
    weight, bias = model.parameters()
    opt = Adagrad([weight, bias] if groups == 1 else [{"params": [weight]}, {"params": [bias]}], lr=0.1)
    # a parameter and its state on two devices, as model.cuda() leaves them: a CPU tensor's .data takes
    # no other device here, so the bias's state goes to "meta" instead
    opt.state[bias]["sum"] = opt.state[bias]["sum"].to("meta")
    weight.grad, bias.grad = torch.ones_like(weight), torch.ones_like(bias)
    before = weight.detach().clone(), bias.detach().clone(), opt.state[weight]["step"].clone()
    message = r"^Adagrad: the state of parameter 1 is on meta .* on cpu: was the model moved"
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    assert torch.equal(weight, before[0]) and torch.equal(bias, before[1])
    assert torch.equal(opt.state[weight]["step"], before[2])


@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("grad_shape", [(3,), (2, 2)], ids=["longer", "wider"])
def test_a_gradient_of_another_shape_is_torchs_error_before_any_change(grad_shape, groups):
    """A gradient set through ``.data`` that torch's per-tensor ops refuse: torch's error, raised after
    torch has updated the parameters before it (and counted the step); here before any change."""

    def attempt(cls):
        a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
        opt = cls([a, b] if groups == 1 else [{"params": [a]}, {"params": [b]}], lr=0.1)
        a.grad, b.grad = torch.ones(2), torch.ones(2)
        b.grad.data = torch.ones(grad_shape)
        return _raised(opt.step), a.detach(), [opt.state[p].get("step") for p in (a, b)]

    theirs, got = attempt(torch.optim.Adagrad), attempt(Adagrad)
    assert got[0] == theirs[0] and theirs[0][0] is RuntimeError
    assert torch.equal(got[1], torch.ones(2)) and all(s is None or s == 0 for s in got[2]), got


def test_a_state_without_step_is_torchs_key_error_before_any_change():
    p = torch.nn.Parameter(torch.randn(4))
    sd = copy.deepcopy(Adagrad([p]).state_dict())
    del sd["state"][0]["step"]
    sd["param_groups"][0]["lr"] = 0.5
    assert _raised(lambda: torch.optim.Adagrad([p]).load_state_dict(copy.deepcopy(sd)))[0] is KeyError
    opt = Adagrad([p], initial_accumulator_value=0.1)
    with pytest.raises(KeyError, match="expected 'step' in the state of each parameter"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 1e-2 and torch.equal(opt.state[p]["sum"], torch.full((4,), 0.1))


def _with_state_set_by_hand(cls, key, value):
    """Two parameters, the second's state[key] replaced by ``value`` (opt.state written directly, past
    load_state_dict's checks), one step: (error or None, parameters, step counts)."""
    a, b = torch.nn.Parameter(torch.linspace(0, 1, 3)), torch.nn.Parameter(torch.linspace(1, 2, 8).view(4, 2))
    opt = cls([a, b], lr=0.1, lr_decay=0.5)
    opt.state[b][key] = value
    error = None
    for t in range(3):
        a.grad, b.grad = torch.sin(a.detach() * (t + 2)), torch.cos(b.detach() * (t + 2))
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001 - compared with torch's below
            error = e
            break
    return error, [a.detach().clone(), b.detach().clone()], [opt.state[p]["step"] for p in (a, b)]


@pytest.mark.parametrize(
    "step", [torch.tensor(0), torch.tensor(0.0, dtype=torch.float64)], ids=["int64", "float64"]
)
def test_a_step_count_set_by_hand_in_another_dtype_steps_as_torch(step):
    """torch counts on in it; the fused update read its memory as float32 (on the GPU: a wrong rate)."""
    theirs = _with_state_set_by_hand(torch.optim.Adagrad, "step", step.clone())
    ours = _with_state_set_by_hand(Adagrad, "step", step.clone())
    assert theirs[0] is None and ours[0] is None, ours[0]
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-6, atol=0)
    assert [float(t) for t in ours[2]] == [float(t) for t in theirs[2]] == [3.0, 3.0]


@pytest.mark.parametrize(
    ("key", "value"),
    [("step", 0.0), ("sum", torch.zeros(2, 2))],
    ids=["step-a-number", "sum-of-another-size"],
)
def test_a_state_set_by_hand_that_torch_refuses_is_its_error_before_any_change(key, value):
    """A step count that is no tensor raised an AttributeError; a sum of another size was refused after
    the other parameters had moved (torch refuses it there too). (A sum of the parameter's size in another
    shape, which torch refuses, is updated element by element: its shape is not checked at each step.)"""
    theirs = _with_state_set_by_hand(torch.optim.Adagrad, key, value)
    ours = _with_state_set_by_hand(Adagrad, key, value)
    assert type(ours[0]) is type(theirs[0]) is RuntimeError and str(ours[0]) == str(theirs[0])
    untouched = [torch.linspace(0, 1, 3), torch.linspace(1, 2, 8).view(4, 2)]
    torch.testing.assert_close(ours[1], untouched, rtol=0, atol=0)
    assert float(ours[2][0]) == 0.0


def test_a_group_added_with_other_differentiable_steps_as_torch():
    """torch steps with grad mode as the optimizer was made: made without differentiable, a group added
    with it updates its leaf parameters as any other's (they were refused with autograd's in-place
    error); made with it, a group added without it is refused with that error (it was updated), here
    before anything changes."""

    def as_torch_2_13(opt, b):
        # torch 2.11's Adagrad makes every state at construction only: its step raises KeyError for a
        # parameter of a group added later. 2.13's (the reference) and tandem's under either make it there.
        if isinstance(opt, torch.optim.Adagrad) and not _torch_makes_state_at_the_step():
            opt.state[b] = {"step": torch.tensor(0.0), "sum": torch.zeros(3)}

    def run(cls, lr):
        a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
        opt = cls([a], lr=0.1)
        opt.add_param_group({"params": [b], "differentiable": True, "lr": lr})
        as_torch_2_13(opt, b)
        for _ in range(2):
            a.grad, b.grad = torch.ones(3), torch.full((3,), 2.0)
            opt.step()
        return [a.detach(), b.detach()]

    for lr in (0.2, torch.tensor(0.2, requires_grad=True)):
        torch.testing.assert_close(run(Adagrad, lr), run(torch.optim.Adagrad, lr), rtol=0, atol=0)

    def made_differentiable(cls):
        q = torch.ones(3, requires_grad=True) * 1.0  # not a leaf: the differentiable update takes it
        b = torch.nn.Parameter(torch.ones(3))
        opt = cls([q], lr=0.1, differentiable=True)
        opt.add_param_group({"params": [b], "differentiable": False})
        as_torch_2_13(opt, b)
        q.grad, b.grad = torch.ones(3), torch.ones(3)
        opt.step()

    error = "a leaf Variable that requires grad is being used in an in-place operation."
    assert _raised(lambda: made_differentiable(torch.optim.Adagrad)) == (RuntimeError, error)
    assert _raised(lambda: made_differentiable(Adagrad)) == (RuntimeError, error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("key", ["lr", "lr_decay"])
def test_the_functional_differentiable_step_refuses_an_lr_or_lr_decay_that_requires_grad(key, dtype):
    """As the optimizer (next test), ``tandem.ops.adagrad(..., differentiable=True)`` in grad mode: torch's
    TypeError, raised by tandem before the step is counted (a float64 lr_decay stepped, a float32 one
    raised after counting it)."""
    from torch.optim.adagrad import adagrad as torch_adagrad

    hyper = {"lr": 0.1, "lr_decay": 0.0, key: torch.tensor(0.05, dtype=dtype, requires_grad=True)}
    said = []
    for fn in (torch_adagrad, tandem.ops.adagrad):
        q = torch.linspace(-1, 1, 4, dtype=torch.float64, requires_grad=True) * 1.0
        s, t = torch.zeros(4, dtype=torch.float64), torch.zeros((), dtype=torch.float32)
        with pytest.raises(TypeError) as caught:
            fn([q], [torch.ones(4, dtype=torch.float64)], [s], [t], weight_decay=0.0, eps=1e-10,
               maximize=False, differentiable=True, **hyper)  # fmt: skip
        said.append((caught.type, t.item(), s.sum().item()))
    assert said[1] == (TypeError, 0.0, 0.0) and said[0][0] is TypeError


@pytest.mark.parametrize("key", ["lr", "lr_decay"])
def test_differentiable_refuses_an_lr_or_lr_decay_that_requires_grad(key):
    """torch's update takes ``clr = lr / (1 + (step - 1) * lr_decay)`` as a number there and refuses a
    tensor that requires grad (a TypeError, after counting the step); the gradient would otherwise be lost
    without a word. tandem stepped with an lr_decay that requires grad."""
    hyper = {"lr": 0.1, key: torch.tensor(0.05, requires_grad=True)}

    def make(cls):
        q = torch.ones(3, requires_grad=True) * 1.0
        q.grad = torch.ones(3)
        return cls([q], differentiable=True, **hyper), q

    assert _raised(make(torch.optim.Adagrad)[0].step)[0] is TypeError
    opt, q = make(Adagrad)
    with pytest.raises(TypeError, match=f"differentiable=True takes {key} as a number"):
        opt.step()
    assert torch.equal(q.detach(), torch.ones(3)) and opt.state[q]["step"].item() == 0


@pytest.mark.parametrize("functional", [False, True], ids=["optimizer", "functional"])
def test_differentiable_keeps_an_eps_that_requires_grad_on_the_tape(functional):
    """torch's update adds eps to the root of the sum on the tape: the parameters' gradient with respect
    to eps is computed. tandem read eps as a float, and that gradient was None."""

    def run(cls, adagrad_fn):
        eps = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
        q = torch.linspace(-1, 1, 4, dtype=torch.float64, requires_grad=True) * 1.0
        if functional:
            s, t = torch.zeros_like(q), torch.zeros((), dtype=torch.float32)
            for k in range(2):
                adagrad_fn([q], [torch.cos(q.detach() * (k + 1))], [s], [t], lr=0.1, lr_decay=0.0,
                           weight_decay=0.0, eps=eps, maximize=False, differentiable=True)  # fmt: skip
        else:
            opt = cls([q], lr=0.1, eps=eps, differentiable=True)
            for k in range(2):
                q.grad = torch.cos(q.detach() * (k + 1))
                opt.step()
        (d_eps,) = torch.autograd.grad(q.sum(), eps)
        return q.detach(), d_eps

    from torch.optim.adagrad import adagrad as torch_adagrad

    (q_got, d_got), (q_want, d_want) = (
        run(Adagrad, tandem.ops.adagrad),
        run(torch.optim.Adagrad, torch_adagrad),
    )
    assert torch.equal(q_got, q_want) and torch.equal(d_got, d_want) and d_want != 0


def test_a_tensor_lr_of_several_elements_set_later_is_torchs_type_error_and_changes_nothing():
    def make(cls):
        p = torch.nn.Parameter(torch.ones(3))
        opt = cls([p], lr=0.1)
        opt.param_groups[0]["lr"] = torch.tensor([0.1, 0.2])
        p.grad = torch.ones(3)
        return opt, p

    assert _raised(make(torch.optim.Adagrad)[0].step)[0] is TypeError
    opt, p = make(Adagrad)
    with pytest.raises(TypeError, match=r"lr as a number or a 1-element tensor, got a tensor of shape \[2\]"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))
    assert opt.state[p]["step"].item() == 0 and torch.equal(opt.state[p]["sum"], torch.zeros(3))


@pytest.mark.parametrize(
    "options",
    [{}, {"foreach": True}, {"weight_decay": 0.1, "maximize": True, "lr_decay": 0.1}, {"tol": 1e-3}],
    ids=["defaults", "foreach", "weight_decay-maximize-lr_decay", "tol"],
)
def test_meta_parameters_step_as_torch(options):
    """Meta tensors (shape inference, deferred initialisation) step without values, as torch's do: the
    step count is read on the host (it once lived on the meta device, where it cannot be read)."""
    results = []
    for cls in (torch.optim.Adagrad, Adagrad):
        params = [torch.nn.Parameter(torch.empty(3, 4, device="meta")), torch.nn.Parameter(torch.empty(5))]
        kwargs = {k: v for k, v in options.items() if k != "tol" or cls is Adagrad}
        opt = cls(params, **kwargs)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        opt.step()
        results.append([(float(opt.state[p]["step"]), opt.state[p]["sum"].device, p.device) for p in params])
    assert results[1] == results[0]


@pytest.mark.parametrize(
    "param",
    [
        pytest.param(lambda: torch.empty(3, device="meta"), id="meta"),
        pytest.param(lambda: torch.zeros(3, dtype=torch.complex64), id="complex"),
    ],
)
def test_fused_on_a_device_or_dtype_it_refuses_raises_torchs_error(param):
    errors = []
    for cls in (torch.optim.Adagrad, Adagrad):
        p = torch.nn.Parameter(param())
        opt = cls([p], fused=True)
        p.grad = torch.ones_like(p)
        with pytest.raises(RuntimeError) as raised:
            opt.step()
        errors.append(str(raised.value))
    assert errors[1] == errors[0]


def test_fused_refuses_cuda_where_torchs_fused_adagrad_has_no_cuda_kernel(monkeypatch):
    """torch 2.11's Adagrad checks fused parameters with ``cuda_unsupported=True`` (its refusal lists the
    devices without 'cuda'); where torch's source says so, ours does the same, and the benchmarks' baseline
    takes foreach on CUDA."""
    from tandem.optim import adagrad

    adagrad._fused_check_options.cache_clear()
    monkeypatch.setattr(adagrad.inspect, "getsource", lambda obj: "check(p, cuda_unsupported=True)")
    try:
        p = torch.nn.Parameter(torch.empty(3, device="meta"))
        p.grad = torch.ones_like(p)
        with pytest.raises(RuntimeError, match="supported devices") as raised:
            Adagrad([p], fused=True).step()
        assert "'cuda'" not in str(raised.value) and "'cpu'" in str(raised.value)
        assert not adagrad.torch_fused_takes(torch.device("cuda"))
        assert adagrad.torch_fused_takes(torch.device("cpu"))
    finally:
        adagrad._fused_check_options.cache_clear()


def test_nan_and_inf_gradients_behave_as_torch():
    init = [torch.randn(6), torch.randn(2, 3)]
    ps_a = [torch.nn.Parameter(x.clone()) for x in init]
    ps_b = [torch.nn.Parameter(x.clone()) for x in init]
    ours, theirs = Adagrad(ps_a, tol=1e-3), torch.optim.Adagrad(ps_b, foreach=False)
    for step in range(3):
        for a, b in zip(ps_a, ps_b):
            g = torch.randn(a.shape)
            if step == 1:
                g.view(-1)[0], g.view(-1)[1] = float("nan"), float("inf")
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        if step >= 1:
            assert not bool(ours.converged) and ours.max_change.item() == float("inf")
    torch.testing.assert_close([p.detach() for p in ps_a], [p.detach() for p in ps_b], equal_nan=True)
    sums_a, sums_b = [ours.state[p]["sum"] for p in ps_a], [theirs.state[p]["sum"] for p in ps_b]
    torch.testing.assert_close(sums_a, sums_b, equal_nan=True)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="defaults"),
        pytest.param(
            {"lr": 0.3, "lr_decay": 0.1, "maximize": True, "initial_accumulator_value": 0.2}, id="options"
        ),
    ],
)
def test_sparse_gradients_match_torch(options):
    torch.manual_seed(0)
    emb_a = torch.nn.Embedding(10, 3, sparse=True)
    emb_b = copy.deepcopy(emb_a)
    dense_a = torch.nn.Parameter(torch.randn(3))
    dense_b = torch.nn.Parameter(dense_a.detach().clone())
    ours = Adagrad([emb_a.weight, dense_a], tol=1e-2, **options)
    theirs = torch.optim.Adagrad([emb_b.weight, dense_b], foreach=False, **options)
    for _ in range(20):
        idx = torch.randint(0, 10, (6,))  # repeats: the gradient must be coalesced
        for emb, dense, opt in ((emb_a, dense_a, ours), (emb_b, dense_b, theirs)):
            opt.zero_grad()
            ((emb(idx) * dense).sum() ** 2).backward()
        before = [emb_a.weight.detach().clone(), dense_a.detach().clone()]
        ours.step()
        theirs.step()
        change = max(
            (emb_a.weight.detach() - before[0]).abs().max(), (dense_a.detach() - before[1]).abs().max()
        )
        assert ours.max_change.item() == change.item()
    torch.testing.assert_close(emb_a.weight, emb_b.weight)
    torch.testing.assert_close(dense_a, dense_b)
    torch.testing.assert_close(ours.state[emb_a.weight]["sum"], theirs.state[emb_b.weight]["sum"])


def test_sparse_gradient_with_weight_decay_raises_before_any_change():
    emb = torch.nn.Embedding(5, 2, sparse=True)
    dense = torch.nn.Parameter(torch.randn(2))
    # the dense parameter's group comes first: it must not move either
    opt = Adagrad([{"params": [dense]}, {"params": [emb.weight]}], weight_decay=0.1)
    (emb(torch.tensor([1, 2])) * dense).sum().backward()
    before = [dense.detach().clone(), emb.weight.detach().clone()]
    with pytest.raises(RuntimeError, match="weight_decay option is not compatible with sparse gradients"):
        opt.step()
    assert torch.equal(dense, before[0]) and torch.equal(emb.weight, before[1])
    assert opt.state[dense]["step"].item() == 0 and opt.state[emb.weight]["step"].item() == 0


def test_amp_grad_scale_and_found_inf_as_torch_fused():
    """What GradScaler hands an optimizer with ``_step_supports_amp_scaling``, given by hand. Whether
    GradScaler does so follows the installed torch's fused Adagrad (torch 2.13 yes, 2.11 no)."""
    init = [torch.randn(5), torch.randn(2, 3)]
    ps_a = [torch.nn.Parameter(x.clone()) for x in init]
    ps_b = [torch.nn.Parameter(x.clone()) for x in init]
    ours, theirs = Adagrad(ps_a, lr=0.1, tol=1.0), torch.optim.Adagrad(ps_b, lr=0.1, fused=True)
    assert ours._step_supports_amp_scaling == getattr(theirs, "_step_supports_amp_scaling", False)
    for found in (0.0, 1.0, 0.0):
        for a, b in zip(ps_a, ps_b):
            g = torch.randn(a.shape) * 1024
            a.grad, b.grad = g.clone(), g.clone()
        for opt in (ours, theirs):
            opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(found)
            opt.step()
            del opt.grad_scale, opt.found_inf
        assert bool(ours.converged) == (found == 0.0)  # a skipped step is not a converged one
        # unscaled in place (or, skipped, not at all)
        torch.testing.assert_close([p.grad for p in ps_a], [p.grad for p in ps_b])
    torch.testing.assert_close([p.detach() for p in ps_a], [p.detach() for p in ps_b])
    assert (
        [ours.state[p]["step"].item() for p in ps_a]
        == [theirs.state[p]["step"].item() for p in ps_b]
        == [2, 2]
    )


def test_grad_scaler_end_to_end_matches_torch_fused():
    torch.manual_seed(0)
    model_a = torch.nn.Linear(4, 2)
    model_b = copy.deepcopy(model_a)
    ours, theirs = (
        Adagrad(model_a.parameters(), lr=0.1),
        torch.optim.Adagrad(model_b.parameters(), lr=0.1, fused=True),
    )
    scalers = [
        torch.amp.GradScaler("cpu", init_scale=2.0**10),
        torch.amp.GradScaler("cpu", init_scale=2.0**10),
    ]
    for step in range(6):
        x = torch.randn(8, 4)
        if step == 2:
            x[0, 0] = float("inf")  # an overflowing step: both skip it and lower the scale
        for model, opt, scaler in ((model_a, ours, scalers[0]), (model_b, theirs, scalers[1])):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() < 2.0**10
    torch.testing.assert_close(list(model_a.parameters()), list(model_b.parameters()))


@pytest.mark.parametrize(
    "dtype, contiguous, torch_kwargs",
    [
        pytest.param(torch.float32, False, {}, id="float32-strided-vs-default"),
        pytest.param(torch.float64, False, {}, id="float64-strided-vs-default"),
        pytest.param(torch.bfloat16, True, {}, id="bfloat16-vs-default"),
        pytest.param(torch.float32, True, {"fused": True}, id="float32-vs-fused"),
        pytest.param(torch.float64, True, {"fused": True}, id="float64-vs-fused"),
    ],
)  # fmt: skip
def test_grad_scaler_with_a_scale_not_a_power_of_two_bit_for_bit(dtype, contiguous, torch_kwargs):
    """Under GradScaler(init_scale=1000): where README promises torch's default's roundings, the gradients
    are unscaled as GradScaler unscales them for it (times the float32 reciprocal); on the fused path,
    as torch's fused Adagrad (torch 2.13's kernel divides by the scale; under 2.11 GradScaler unscales
    them first, as for the default)."""
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(24, 16, generator=gen, dtype=torch.float64).to(dtype)
    xs = [torch.randn(24, 8, generator=gen, dtype=torch.float64).to(dtype) for _ in range(4)]
    xs[2][0, 0] = float("inf")  # a skipped step: the scale drops to 500
    runs = []
    for make in (lambda ps: Adagrad(ps, lr=0.1), lambda ps: torch.optim.Adagrad(ps, lr=0.1, **torch_kwargs)):
        w = torch.nn.Parameter(init.clone() if contiguous else init.t().contiguous().t())
        assert w.is_contiguous() == contiguous
        opt = make([w])
        scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=1000)
        for x in xs:
            opt.zero_grad()
            scaler.scale((x.t() @ w).float().sin().sum()).backward()
            scaler.step(opt)
            scaler.update()
        runs.append((w.detach(), w.grad, opt.state[w]["sum"], scaler.get_scale()))
    (w_a, g_a, s_a, scale_a), (w_b, g_b, s_b, scale_b) = runs
    assert scale_a == scale_b == 500.0
    assert torch.equal(g_a, g_b) and torch.equal(s_a, s_b) and torch.equal(w_a, w_b)


def test_grad_scaler_with_a_scale_not_a_power_of_two_and_sparse_gradients_bit_for_bit():
    """Sparse gradients take the per-tensor path: unscaled as GradScaler unscales them for torch's."""
    torch.manual_seed(0)
    emb_a = torch.nn.Embedding(6, 3, sparse=True)
    emb_b = copy.deepcopy(emb_a)
    w = torch.randn(3)
    runs = []
    for emb, opt in (
        (emb_a, Adagrad(emb_a.parameters(), lr=0.1)),
        (emb_b, torch.optim.Adagrad(emb_b.parameters(), lr=0.1)),
    ):
        scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=1000)
        for step in range(4):
            opt.zero_grad()
            scaler.scale((emb(torch.tensor([1, 1, 2, step])) @ w).pow(2).sum()).backward()
            scaler.step(opt)
            scaler.update()
        runs.append((emb.weight.detach(), opt.state[emb.weight]["sum"]))
    (w_a, s_a), (w_b, s_b) = runs
    assert torch.equal(s_a, s_b) and torch.equal(w_a, w_b)


def test_deepcopy_pickle_and_torch_save_keep_tol():
    """A copy of the optimizer keeps tol, its converged flag and its largest change (torch's
    Optimizer.__getstate__ keeps only defaults, state and param_groups), and goes on as torch's copy."""
    init = torch.randn(5, 3)
    ours = Adagrad([torch.nn.Parameter(init.clone())], lr=0.1, tol=0.5)
    theirs = torch.optim.Adagrad([torch.nn.Parameter(init.clone())], lr=0.1, fused=True)
    grads = [torch.randn(5, 3) for _ in range(2)]
    for opt in (ours, theirs):
        opt.param_groups[0]["params"][0].grad = grads[0].clone()
        opt.step()

    def saved(opt):
        buffer = io.BytesIO()
        torch.save(opt, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    for copy_of in (copy.deepcopy, lambda opt: pickle.loads(pickle.dumps(opt)), saved):
        ours_copy, theirs_copy = copy_of(ours), copy_of(theirs)
        assert ours_copy.tol == 0.5
        assert torch.equal(ours_copy.converged, ours.converged)
        assert torch.equal(ours_copy.max_change, ours.max_change)
        p, q = ours_copy.param_groups[0]["params"][0], theirs_copy.param_groups[0]["params"][0]
        before = q.detach().clone()
        p.grad, q.grad = grads[1].clone(), grads[1].clone()
        ours_copy.step()
        theirs_copy.step()
        change = (q.detach() - before).abs().max()
        assert torch.equal(p, q)
        assert ours_copy.max_change.item() == change.item()
        assert bool(ours_copy.converged) == (change.item() <= 0.5)


def test_differentiable_step_matches_torch():
    def step_output(opt_cls, p, g, s):
        q = p.clone()  # a non-leaf parameter: only differentiable optimizers accept it
        q.grad = g
        opt = opt_cls([q], lr=0.1, weight_decay=0.05, differentiable=True)
        opt.state[q]["sum"] = s.clone()
        opt.step()
        return q

    gen = torch.Generator().manual_seed(0)
    p = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    s = torch.rand(4, generator=gen, dtype=torch.float64, requires_grad=True)
    ours = step_output(Adagrad, p, g, s)
    theirs = step_output(torch.optim.Adagrad, p, g, s)
    torch.testing.assert_close(ours, theirs)
    d_ours = torch.autograd.grad(ours.sum(), (p, g, s))
    d_theirs = torch.autograd.grad(theirs.sum(), (p, g, s))
    torch.testing.assert_close(d_ours, d_theirs)


def test_param_groups_missing_grads_tensor_lr_and_closure():
    a, b, c = (torch.nn.Parameter(torch.randn(3)) for _ in range(3))
    a2, b2, c2 = (torch.nn.Parameter(x.detach().clone()) for x in (a, b, c))
    groups = lambda x, y, z: [{"params": [x, y]}, {"params": [z], "lr": 0.5}]  # noqa: E731
    ours = Adagrad(groups(a, b, c), lr=torch.tensor(0.1), tol=1e-6)
    theirs = torch.optim.Adagrad(groups(a2, b2, c2), lr=torch.tensor(0.1), foreach=False)
    for x, y in ((a, a2), (c, c2)):  # b gets no gradient: it must not move, and its state stays
        x.grad = torch.ones(3)
        y.grad = torch.ones(3)
    loss = ours.step(closure=lambda: torch.tensor(3.0))
    theirs.step()
    assert loss.item() == 3.0
    torch.testing.assert_close([a, b, c], [a2, b2, c2])
    assert ours.state[b]["step"].item() == 0 and ours.state[c]["step"].item() == 1


def test_exported_from_tandem_and_share_memory():
    assert tandem.optim.Adagrad is Adagrad
    opt = Adagrad([torch.nn.Parameter(torch.zeros(2))])
    opt.share_memory()
    assert all(opt.state[p]["sum"].is_shared() for p in opt.param_groups[0]["params"])


def _step_outcome(opt: torch.optim.Optimizer) -> str:
    try:
        opt.step()
        return "stepped"
    except (RuntimeError, TypeError) as e:
        return type(e).__name__ + (": " + str(e) if not str(e).startswith("_fused_adagrad_()") else "")


@pytest.mark.parametrize(
    "case", ["zero-size-tracked", "fused-sparse-decay", "fused-maximize-int", "leaf-differentiable"]
)
def test_refusals_and_edge_steps_as_torch(case):
    """What a randomised comparison with torch found: tol= with a zero-size parameter alone in its dtype
    (amax of nothing raised; torch steps), a sparse gradient under fused=True with weight_decay (torch's
    fused refusal comes first), an int maximize under fused=True (torch's fused op takes a bool: its
    TypeError), and differentiable=True on leaf parameters (torch raises autograd's in-place error after
    it counted the step and added to the sum; tandem raises it before anything changes)."""
    outcomes, states = [], []
    for cls in (torch.optim.Adagrad, Adagrad):
        kwargs = {"tol": 0.0} if cls is Adagrad and case == "zero-size-tracked" else {}
        if case == "zero-size-tracked":
            ps = [
                torch.nn.Parameter(torch.zeros(0, 3, dtype=torch.float64)),
                torch.nn.Parameter(torch.ones(2)),
            ]
            grads = [torch.zeros(0, 3, dtype=torch.float64), torch.ones(2)]
        elif case == "fused-sparse-decay":
            ps = [torch.nn.Parameter(torch.ones(4, 2))]
            grads = [torch.sparse_coo_tensor([[1, 3]], torch.ones(2, 2), (4, 2))]
            kwargs |= {"fused": True, "weight_decay": 0.1}
        elif case == "fused-maximize-int":
            ps, grads = [torch.nn.Parameter(torch.ones(3))], [torch.ones(3)]
            kwargs |= {"fused": True}
        else:
            ps, grads = (
                [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))],
                [torch.ones(2)] * 2,
            )
            kwargs |= {"differentiable": True}
        opt = cls(ps, lr=0.1, **kwargs)
        if case == "fused-maximize-int":
            opt.param_groups[0]["maximize"] = 1
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        outcomes.append(_step_outcome(opt))
        states.append(
            [
                (float(opt.state[p]["step"]), opt.state[p]["sum"].tolist()) if opt.state[p] else None
                for p in ps
            ]
        )
    assert outcomes[1] == outcomes[0]
    if case == "leaf-differentiable":
        assert outcomes[0].startswith("RuntimeError: a leaf Variable that requires grad")
        assert states[1] == [(0.0, [0.0, 0.0])] * 2  # nothing changed (torch's first parameter moved on)
    elif case == "zero-size-tracked":
        assert outcomes[0] == "stepped" and states[1] == states[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("tracked", [False, True], ids=["plain", "tol"])
def test_a_step_counts_a_version_so_a_kept_graph_refuses_a_second_backward_as_torchs(dtype, tracked):
    """torch's default updates the parameters with in-place ops, which count their versions: a graph kept
    with ``retain_graph`` that saved a parameter refuses a backward after the step. The fused CPU kernel
    writes behind autograd's back, and the second backward ran on the new values without a word (as it
    does with torch's ``fused=True``)."""
    said = []
    for make in (torch.optim.Adagrad, lambda ps, **kw: Adagrad(ps, tol=1e-9 if tracked else None, **kw)):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 4, dtype=dtype))
        opt = make([p], lr=0.1)
        loss = (p * p).sum()  # saves p
        loss.backward(retain_graph=True)
        version = p._version
        opt.step()
        try:
            loss.backward()
            said.append((p._version > version, None))
        except RuntimeError as e:
            said.append((p._version > version, str(e).split(";")[0]))
    assert said[1] == said[0] and said[0][1] is not None
