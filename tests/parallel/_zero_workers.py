"""What each spawned Gloo rank of ``test_zero.py`` runs, and the model, data and training both sides share.

A rank runs every check of one scenario and saves the results to ``<result_dir>/rank<r>.pt``; the test
process computes the single-process ``torch.optim.Adagrad`` references with the same helpers.
"""

from __future__ import annotations

import copy
import datetime
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from _ranks import join_group

from tandem.parallel import DistributedDataParallel, ZeroAdagrad

LOCAL_BATCH = 4
TIMEOUT_S = 15.0
STEPS = 4  # before the state is consolidated or loaded
MORE = 3  # after


def model(seed: int = 7) -> torch.nn.Module:
    """107 float64 parameters in 6 tensors: no shard boundary of 2 or 3 ranks falls between tensors."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    ).double()


HYPER = dict(lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-10)


def groups(m: torch.nn.Module) -> list[dict[str, Any]]:
    """Two groups with different hyperparameters (the first layer alone, then the rest)."""
    params = list(m.parameters())
    return [{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.05, "weight_decay": 0.01}]


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: rank r trains on chunk r, the reference on all of it."""
    g = torch.Generator().manual_seed(2000 + step)
    n = LOCAL_BATCH * world
    return (
        torch.randn(n, 6, generator=g, dtype=torch.float64),
        torch.randn(n, 3, generator=g, dtype=torch.float64),
    )


def train(
    forward: Callable[[torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    steps: range,
    world: int,
    rank: int | None,
) -> None:
    """Adagrad steps on a rank's chunk of each batch, or on the whole batch (``rank=None``)."""
    for step in steps:
        x, y = batch(step, world)
        if rank is not None:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        ((forward(x) - y) ** 2).mean().backward()
        opt.step()


def reference(world: int, steps: range, start: torch.nn.Module | None = None):
    """Single-process torch.optim.Adagrad on the concatenated batches: (model, optimizer)."""
    m = start if start is not None else model()
    opt = torch.optim.Adagrad(groups(m), **HYPER)
    train(m, opt, steps, world, None)
    return m, opt


def params(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def _check_one_rank_refuses(rank: int, world: int) -> dict[str, Any]:
    """The last rank's constructor refuses its lr, and that rank lives on: the others waited in their
    agreement for the whole timeout (the group's, 30 minutes by default), then raised a CommunicationError.
    Each now raises at once, a ValueError naming the refusal."""
    start = time.monotonic()
    lr = -1.0 if rank == world - 1 else 0.1
    error = _raises(lambda: ZeroAdagrad(model().parameters(), lr=lr, timeout=60.0))
    return {"error": error, "seconds": time.monotonic() - start}


def _raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# ----------------------------------------------------------------------------------------------
# checks


def _check_train_and_state(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    m = model()
    ddp = DistributedDataParallel(m, timeout=TIMEOUT_S)
    opt = ZeroAdagrad(groups(m), **HYPER, timeout=TIMEOUT_S)
    train(ddp, opt, range(STEPS), world, rank)
    out["params"] = params(m)
    out["state_numel"] = sum(opt.state[p]["sum"].numel() for p in m.parameters())
    out["storages"] = {opt.state[p]["sum"].untyped_storage().data_ptr() for p in m.parameters()}
    out["steps"] = [float(opt.state[p]["step"]) for p in m.parameters()]

    # Consolidate on the last rank (not 0), load into torch.optim.Adagrad there, and go on both ways.
    to = world - 1
    opt.consolidate_state_dict(to=to)
    if rank == to:
        full = opt.state_dict()
        out["consolidated"] = copy.deepcopy(full)  # torch's load_state_dict keeps (and then updates) it
        theirs = model()
        with torch.no_grad():
            for a, b in zip(theirs.parameters(), m.parameters()):
                a.copy_(b)
        torch_opt = torch.optim.Adagrad(groups(theirs), **HYPER)
        torch_opt.load_state_dict(full)
        train(theirs, torch_opt, range(STEPS, STEPS + MORE), world, None)
        out["torch_continued"] = params(theirs)
    else:
        out["elsewhere"] = _raises(opt.state_dict)
    train(ddp, opt, range(STEPS, STEPS + MORE), world, rank)
    out["zero_continued"] = params(m)
    out["stale"] = _raises(opt.state_dict) if rank == to else None
    return out


def _check_load(rank: int, world: int) -> dict[str, Any]:
    """A torch.optim.Adagrad checkpoint (every rank computes the same one) loaded into ZeroAdagrad."""
    torch_model, torch_opt = reference(world, range(STEPS))
    m = model()
    with torch.no_grad():
        for a, b in zip(m.parameters(), torch_model.parameters()):
            a.copy_(b)
    ddp = DistributedDataParallel(m, timeout=TIMEOUT_S)
    opt = ZeroAdagrad(groups(m), lr=1.0, timeout=TIMEOUT_S)  # the loaded groups bring the real values
    opt.load_state_dict(torch_opt.state_dict())
    train(ddp, opt, range(STEPS, STEPS + MORE), world, rank)
    return {"params": params(m), "lr": [g["lr"] for g in opt.param_groups]}


def _check_bad_arguments(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    m = model()
    out["lr"] = _raises(lambda: ZeroAdagrad(m.parameters(), lr=-1.0))
    out["eps"] = _raises(lambda: ZeroAdagrad(m.parameters(), eps=-1.0))
    out["timeout"] = _raises(lambda: ZeroAdagrad(m.parameters(), timeout=0))
    out["timeout_text"] = _raises(lambda: ZeroAdagrad(m.parameters(), timeout="5"))
    # no deadline: the construction's collectives wait on threading's events, which refuse ~292 years
    out["timeout_inf"] = _raises(lambda: ZeroAdagrad(m.parameters(), timeout=float("inf")))
    out["timeout_max"] = _raises(lambda: ZeroAdagrad(m.parameters(), timeout=datetime.timedelta.max))
    out["differentiable"] = _raises(lambda: ZeroAdagrad(m.parameters(), differentiable=True))
    both = dict(fused=True, differentiable=True)  # torch's check of the pair comes first
    out["fused_differentiable"] = (
        _raises(lambda: ZeroAdagrad(m.parameters(), **both)),
        _raises(lambda: torch.optim.Adagrad(m.parameters(), **both)),
    )
    first = next(m.parameters())
    out["duplicate"] = _raises(lambda: ZeroAdagrad([first, first]))

    opt = ZeroAdagrad(groups(m), **HYPER, timeout=TIMEOUT_S)
    ps = list(m.parameters())
    before = ([p.detach().clone() for p in ps], [opt.state[p]["sum"].clone() for p in ps])

    def unchanged() -> bool:
        now = ([p.detach().clone() for p in ps], [opt.state[p]["sum"].clone() for p in ps])
        return all(torch.equal(a, b) for x, y in zip(before, now) for a, b in zip(x, y)) and all(
            float(opt.state[p]["step"]) == 0 for p in ps
        )

    out["to_range"] = _raises(lambda: opt.consolidate_state_dict(to=world))
    out["to_bool"] = _raises(lambda: opt.consolidate_state_dict(to=True))
    out["state_dict_first"] = _raises(opt.state_dict)
    out["add_group"] = _raises(lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]}))

    good = reference(world, range(1))[1].state_dict()
    one_group = {"state": good["state"], "param_groups": good["param_groups"][:1]}
    out["load_groups"] = _raises(lambda: opt.load_state_dict(one_group))
    bad_sum = {
        "state": {**good["state"], 5: {**good["state"][5], "sum": torch.zeros(4, dtype=torch.float64)}},
        "param_groups": good["param_groups"],
    }
    out["load_shape"] = _raises(lambda: opt.load_state_dict(bad_sum))
    no_sum = {
        "state": {**good["state"], 2: {"step": good["state"][2]["step"]}},
        "param_groups": good["param_groups"],
    }
    out["load_no_sum"] = _raises(lambda: opt.load_state_dict(no_sum))  # torch's KeyError at its next step

    # A sparse gradient on the last parameter: nothing moves, not even the parameters before it.
    for p in ps:
        p.grad = torch.ones_like(p)
    ps[-1].grad = torch.ones_like(ps[-1]).to_sparse()
    out["sparse_grad"] = _raises(opt.step)
    # A gradient on some ranks only (rank 1 has none for the first parameter): refused on every rank.
    for p in ps:
        p.grad = torch.ones_like(p)
    if rank == 1:
        ps[0].grad = None
    out["grad_on_some_ranks"] = _raises(opt.step)
    out["unchanged"] = unchanged()
    return out


class Mixed(torch.nn.Module):
    """A float64 and a float32 layer: two flat spaces, each cut into its own shards."""

    def __init__(self, seed: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(6, 5).double()
        self.b = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).float()).double()


def _check_mixed_dtypes(rank: int, world: int) -> dict[str, Any]:
    m = Mixed()
    opt = ZeroAdagrad(m.parameters(), lr=0.1, **HYPER, timeout=TIMEOUT_S)
    train(DistributedDataParallel(m, timeout=TIMEOUT_S), opt, range(STEPS), world, rank)
    return {"params": params(m), "shards": {str(k[1]): v.numel() for k, v in opt._shards.items()}}


HALF_SIZES = (1000, 4099, 70)  # cuts fall inside the first two at any world size


def half_params() -> list[torch.nn.Parameter]:
    torch.manual_seed(10)
    return [
        torch.nn.Parameter(torch.randn(n).to(dt))
        for dt in (torch.bfloat16, torch.float16)
        for n in HALF_SIZES
    ]


def half_grads(step: int, ps: list[torch.nn.Parameter]) -> None:
    """The same (already averaged) gradients on every rank."""
    torch.manual_seed(100 + step)
    for p in ps:
        p.grad = (torch.randn(p.shape) * 1e-2).to(p.dtype)


def _check_half_weight_decay(rank: int, world: int) -> dict[str, Any]:
    """bfloat16 and float16 parameters with weight decay: torch's per-element ops round a half type
    otherwise in their vectorised body than in its tail, so a shard cut anywhere inside a parameter gave a
    few elements other bits than torch.optim.Adagrad's step of the whole parameter."""
    ps = half_params()
    opt = ZeroAdagrad(ps, lr=0.1, weight_decay=0.01, timeout=TIMEOUT_S)
    for step in range(3):
        half_grads(step, ps)
        opt.step()
    return {"params": [p.detach().clone() for p in ps]}


def _check_mismatch(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 passes one parameter more: every rank raises, none hangs."""
    m = model()
    extra = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))] if rank == 0 else []
    return {"error": _raises(lambda: ZeroAdagrad([*m.parameters(), *extra], timeout=TIMEOUT_S))}


def _check_group_initial_value(rank: int, world: int) -> dict[str, Any]:
    """A group's own initial_accumulator_value is not used: torch.optim.Adagrad starts every sum from
    the constructor's."""

    def make(cls, m, **kw):
        ps = list(m.parameters())
        return cls(
            [{"params": ps[:2], "initial_accumulator_value": 1.0}, {"params": ps[2:]}],
            lr=0.1,
            initial_accumulator_value=0.25,
            **kw,
        )

    ours = model()
    train(
        DistributedDataParallel(ours, timeout=TIMEOUT_S),
        make(ZeroAdagrad, ours, timeout=TIMEOUT_S),
        range(STEPS),
        world,
        rank,
    )
    theirs = model()
    train(theirs, make(torch.optim.Adagrad, theirs), range(STEPS), world, None)
    return {"tandem": params(ours), "torch": params(theirs)}


def _check_state_dict_hooks(rank: int, world: int) -> dict[str, Any]:
    """The four state-dict hooks of torch.optim.Optimizer run as in torch.optim.Adagrad: a post hook's
    replacement is what state_dict() returns, a pre hook's is what load_state_dict() loads."""

    def hooked(opt: torch.optim.Optimizer, log: list[str]) -> None:
        opt.register_state_dict_pre_hook(lambda o: log.append("save pre"))
        opt.register_state_dict_post_hook(lambda o, sd: log.append("save post") or {**sd, "note": rank})
        opt.register_load_state_dict_pre_hook(
            lambda o, sd: (
                log.append(f"load pre {sd.pop('note', None)}") or {**sd, "param_groups": lr_half(sd)}
            )
        )
        opt.register_load_state_dict_post_hook(lambda o: log.append("load post"))

    def lr_half(sd: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**g, "lr": g["lr"] / 2} for g in sd["param_groups"]]

    m = model()
    opt = ZeroAdagrad(groups(m), **HYPER, timeout=TIMEOUT_S)
    theirs = model()
    torch_opt = torch.optim.Adagrad(groups(theirs), **HYPER)
    logs: dict[str, list[str]] = {"tandem": [], "torch": []}
    hooked(opt, logs["tandem"])
    hooked(torch_opt, logs["torch"])
    train(DistributedDataParallel(m, timeout=TIMEOUT_S), opt, range(1), world, rank)
    train(theirs, torch_opt, range(1), world, None)
    opt.consolidate_state_dict(to=0)
    saved = {"torch": torch_opt.state_dict()}
    if rank == 0:
        saved["tandem"] = opt.state_dict()
    opt.load_state_dict(saved["torch"])
    torch_opt.load_state_dict(saved["torch"])
    return {
        "logs": logs,
        "notes": {k: v.get("note") for k, v in saved.items()},
        "lr": {
            "tandem": [g["lr"] for g in opt.param_groups],
            "torch": [g["lr"] for g in torch_opt.param_groups],
        },
    }


def conv(seed: int = 9) -> torch.nn.Module:
    """A float64 convolution (144 + 4 parameters: shard boundaries fall inside its weight)."""
    torch.manual_seed(seed)
    return torch.nn.Conv2d(4, 4, 3).double()


def conv_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(2, 4, 5, 5, generator=g, dtype=torch.float64).to(memory_format=torch.channels_last)


def train_channels_last(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """The whole batch on every rank (the same gradients everywhere, as DDP's averaged ones); the weight
    has no gradient at step 1 (its copy must still take the other ranks' shards)."""
    for step in steps:
        opt.zero_grad()
        m(conv_batch(step)).sin().sum().backward()
        if step == 1:
            m.weight.grad = None
        opt.step()


def _check_channels_last(rank: int, world: int) -> dict[str, Any]:
    """A model converted to channels_last after the optimizer was made (its weight, the same Parameter,
    is no longer contiguous), and one converted before (refused once)."""
    out = {}
    for when in ("after", "before"):
        m = conv()
        if when == "before":
            m.to(memory_format=torch.channels_last)
        opt = ZeroAdagrad(m.parameters(), lr=0.1, **HYPER, timeout=TIMEOUT_S)
        m.to(memory_format=torch.channels_last)
        assert not m.weight.is_contiguous()
        train_channels_last(m, opt, range(STEPS))
        out[when] = {
            "params": params(m),
            "channels_last": m.weight.is_contiguous(memory_format=torch.channels_last),
        }
    return out


def checkpoint_without_state(world: int) -> dict[str, Any]:
    """torch.optim.Adagrad's state dict after STEPS steps, without parameter 3's state (as after an
    add_param_group whose parameter had no gradient yet) and with a tensor lr in group 0."""
    sd = reference(world, range(STEPS))[1].state_dict()
    del sd["state"][3]
    sd["param_groups"][0]["lr"] = torch.tensor(0.1, dtype=torch.float64)  # a float32 one rounds the rate
    return sd


def _check_load_replaces_state(rank: int, world: int) -> dict[str, Any]:
    """Trained for STEPS steps, then loaded with checkpoint_without_state and trained on, with a
    scheduler that changes the tensor lr in place."""
    m = model()
    ddp = DistributedDataParallel(m, timeout=TIMEOUT_S)
    opt = ZeroAdagrad(groups(m), **HYPER, timeout=TIMEOUT_S)
    train(ddp, opt, range(STEPS), world, rank)
    sd = checkpoint_without_state(world)
    saved_model = reference(world, range(STEPS))[0]
    with torch.no_grad():
        for a, b in zip(m.parameters(), saved_model.parameters()):
            a.copy_(b)
    opt.load_state_dict(sd)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(STEPS, STEPS + MORE):
        train(ddp, opt, range(step, step + 1), world, rank)
        sched.step()
    return {"params": params(m), "checkpoint_lr": float(sd["param_groups"][0]["lr"])}


def _check_refusals(rank: int, world: int) -> dict[str, Any]:
    """What one rank or every rank refuses, each raised on every rank with nothing moved anywhere: the
    model converted after the optimizer was made (its shards were cut for the old dtype: wrong numbers,
    ranks apart, or Gloo aborting), a parameter grown through .data (its new elements never stepped), a
    sparse gradient on one rank only (the other ranks stepped), a 2-element tensor lr (torch's
    TypeError), and a state dict whose step is no number (the groups were loaded before it raised). A
    frozen parameter that a graph saved keeps its version through a step (a broadcast into it made that
    graph's backward raise on the ranks that do not own it)."""
    out: dict[str, Any] = {}

    def attempt(name: str, m: torch.nn.Module, opt: ZeroAdagrad, fn: Callable[[], Any]) -> None:
        before = [p.detach().clone() for p in m.parameters()]
        sums = [opt.state[p]["sum"].clone() for p in m.parameters()]
        out[name] = {
            "error": _raises(fn),
            "moved": any(not torch.equal(a, b.to(a.dtype)) for a, b in zip(before, m.parameters()))
            or any(not torch.equal(a, opt.state[p]["sum"]) for a, p in zip(sums, m.parameters()))
            or any(opt.state[p]["step"].item() != 1 for p in m.parameters()),
        }

    def one_step() -> tuple[torch.nn.Module, ZeroAdagrad]:
        m = model()
        opt = ZeroAdagrad(groups(m), **HYPER, timeout=TIMEOUT_S)
        train(m, opt, range(1), world, None)  # the whole batch on every rank: the same gradients
        return m, opt

    def grads_and_step(m: torch.nn.Module, opt: ZeroAdagrad) -> None:
        x, y = batch(1, world)
        opt.zero_grad()
        ((m(x.to(m[0].weight.dtype)) - y.to(m[0].weight.dtype)) ** 2).mean().backward()
        opt.step()

    m, opt = one_step()
    m.float()
    attempt("converted", m, opt, lambda: grads_and_step(m, opt))
    m, opt = one_step()
    m[4].bias.data = torch.zeros(5, dtype=torch.float64)
    m[4].bias.grad = torch.ones(5, dtype=torch.float64)
    attempt("grown", m, opt, opt.step)
    m, opt = one_step()
    train(m, torch.optim.SGD(m.parameters(), lr=0.0), range(1), world, None)  # gradients, no step
    if rank == world - 1:
        m[0].weight.grad = m[0].weight.grad.to_sparse()
    attempt("one_rank_refuses", m, opt, opt.step)
    m, opt = one_step()
    opt.param_groups[1]["lr"] = torch.tensor([0.1, 0.2], dtype=torch.float64)
    train(m, torch.optim.SGD(m.parameters(), lr=0.0), range(1), world, None)
    attempt("lr_of_two_elements", m, opt, opt.step)
    m, opt = one_step()
    sd = reference(world, range(1))[1].state_dict()
    sd["param_groups"][0]["lr"] = 0.5
    sd["state"][1]["step"] = torch.tensor([1.0, 2.0])
    attempt("bad_step_loaded", m, opt, lambda: opt.load_state_dict(sd))
    out["bad_step_loaded"]["lr"] = opt.param_groups[0]["lr"]

    # a frozen first layer that a graph saved: a step of the others leaves its version alone
    m = model()
    opt = ZeroAdagrad(m.parameters(), **HYPER, timeout=TIMEOUT_S)
    m[0].requires_grad_(False)
    x, y = batch(2, world)
    kept = m[0](x.requires_grad_())  # saves the frozen weight for x's gradient
    ((m(x) - y) ** 2).mean().backward(retain_graph=True)
    version = m[0].weight._version
    opt.step()
    out["frozen"] = {
        "version_kept": m[0].weight._version == version,
        "backward": _raises(lambda: kept.sum().backward()),
    }
    # the same for a channels_last weight, which steps through a contiguous copy: one without a gradient
    # is not copied back
    m = conv().to(memory_format=torch.channels_last)
    opt = ZeroAdagrad(m.parameters(), **HYPER, timeout=TIMEOUT_S)
    m.weight.requires_grad_(False)
    kept = m(conv_batch(0).requires_grad_())
    kept.sum().backward(retain_graph=True)
    version = m.weight._version
    opt.step()
    out["frozen_channels_last"] = {
        "version_kept": m.weight._version == version,
        "backward": _raises(lambda: kept.sum().backward()),
    }
    return out


CHECKS = {
    "state_dict_hooks": _check_state_dict_hooks,
    "group_initial_value": _check_group_initial_value,
    "train": _check_train_and_state,
    "load": _check_load,
    "mixed_dtypes": _check_mixed_dtypes,
    "half_weight_decay": _check_half_weight_decay,
    "bad_arguments": _check_bad_arguments,
    "mismatch": _check_mismatch,
    "channels_last": _check_channels_last,
    "load_replaces_state": _check_load_replaces_state,
    "refusals": _check_refusals,
    "one_rank_refuses": _check_one_rank_refuses,
}


def entry(rank: int, world: int, store: str, result_dir: str) -> None:
    """Process entry point: run every check as ``rank`` and save what each returns (or its error)."""
    results: dict[str, Any] = {}
    try:
        join_group(rank, world, store)
        for name, check in CHECKS.items():
            try:
                results[name] = check(rank, world)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
    except Exception:
        results = {"fatal": traceback.format_exc()}
    torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    os._exit(0)  # no process-group teardown to wait for
