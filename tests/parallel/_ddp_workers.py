"""What each spawned Gloo rank of ``test_ddp.py`` runs, and the models and data both sides share.

A rank runs one scenario and saves its results to ``<result_dir>/rank<r>.pt``; the test process (which
also computes the single-process references with the same helpers) compares. Each check of the
``main`` scenario records its own error, so one failing check does not hide the others.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import os
import signal
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from _ranks import join_group
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

import tandem
from tandem.parallel import DistributedDataParallel as TandemDDP
from tandem.parallel import hooks

TorchDDP = torch.nn.parallel.DistributedDataParallel
ONE_BYTE_MB = 1 / 2**20  # a bucket cap every parameter exceeds: one parameter per bucket
LOCAL_BATCH = 4
CHECK_TIMEOUT_S = 15.0  # tandem's collective timeout inside the correctness checks


# ----------------------------------------------------------------------------------------------
# models and data (shared with the single-process references in test_ddp.py)


def mlp(dtype: torch.dtype = torch.float64, seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).to(dtype)


def bn_mlp(seed: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).double()


class GRUNet(torch.nn.Module):
    """A small DeepSpeech-like stack: bidirectional tandem.nn.GRU layers and a linear head."""

    def __init__(self, seed: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.rnn = tandem.nn.GRU(
            6, 5, num_layers=2, bidirectional=True, batch_first=True, dtype=torch.float64
        )
        self.head = torch.nn.Linear(10, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out)


def syncbn_mlp(seed: int = 6) -> torch.nn.Module:
    """tandem.nn.SyncBatchNorm between the layers: its backward all-reduces while DDP's buckets go out."""
    torch.manual_seed(seed)
    sbn = tandem.nn.SyncBatchNorm
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), sbn(8), torch.nn.Tanh(), torch.nn.Linear(8, 8), sbn(8), torch.nn.Tanh(),
        torch.nn.Linear(8, 3),
    ).double()  # fmt: skip


class Branchy(torch.nn.Module):
    """``c`` is used only when asked; ``frozen`` never needs a gradient."""

    def __init__(self, seed: int = 4) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(6, 8).double()
        self.b = torch.nn.Linear(8, 3).double()
        self.c = torch.nn.Linear(8, 3).double()
        self.frozen = torch.nn.Parameter(torch.ones(3, dtype=torch.float64), requires_grad=False)

    def forward(self, x: torch.Tensor, use_c: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        out = self.b(h) * self.frozen
        return out + self.c(h) if use_c else out


class Heads(Branchy):
    """Branchy's layers, but ``b`` is the one used only when asked: registered before ``c``, its bucket
    comes after c's, which goes out while b's waits."""

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.c(h) + self.b(h) if use_b else self.c(h)


class Ordered(torch.nn.Module):
    """Parameters registered in the opposite order of their use: the initial buckets are wrong."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.late = torch.nn.Linear(8, 3).double()
        self.early = torch.nn.Linear(6, 8).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(torch.tanh(self.early(x)))


def batch(step: int, world: int, kind: str = "mlp") -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: rank r trains on chunk r, the reference on all of it."""
    g = torch.Generator().manual_seed(1000 + step)
    n = LOCAL_BATCH * world
    if kind == "gru":
        return torch.randn(n, 7, 6, generator=g, dtype=torch.float64), torch.randn(
            n, 7, 3, generator=g, dtype=torch.float64
        )
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(
        n, 3, generator=g, dtype=torch.float64
    )


def local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world)[rank]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y.to(out.dtype)) ** 2).mean()


def train(model: torch.nn.Module, steps: int, world: int, rank: int | None, kind: str = "mlp") -> None:
    """SGD with momentum on ``steps`` batches: a rank's chunk, or the whole batch (``rank=None``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(step, world, kind)
        if rank is not None:
            x, y = local(x, rank, world), local(y, rank, world)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


def train_no_sync(model: torch.nn.Module, wrapper, rounds: int, micro: int, world: int, rank: int | None):
    """``micro - 1`` backward passes under no_sync() then one synchronised, per round."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for r in range(rounds):
        opt.zero_grad()
        for k in range(micro):
            x, y = batch(10 * r + k, world)
            if rank is not None:
                x, y = local(x, rank, world), local(y, rank, world)
            sync = wrapper is None or k == micro - 1
            ctx = wrapper.no_sync() if not sync else _nullcontext()
            with ctx:
                loss_fn((wrapper or model)(x), y).backward()
        opt.step()


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------
# the main scenario: every correctness check in one process group


def _check_single_process(rank: int, world: int) -> dict[str, Any]:
    out = {}
    m = mlp()
    train(TandemDDP(m, bucket_cap_mb=0, timeout=CHECK_TIMEOUT_S), 3, world, rank)
    out["tiny_buckets"] = params(m)
    m = mlp()
    ddp = TandemDDP(m, bucket_cap_mb=0.0001, gradient_as_bucket_view=True, timeout=CHECK_TIMEOUT_S)
    train(ddp, 3, world, rank)
    out["bucket_view"] = params(m)
    out["bucket_view_is_view"] = all(
        p.grad is not None and any(p.grad.data_ptr() == v.data_ptr() for b in ddp._buckets for v in b.views)
        for p in m.parameters()
    )
    m = mlp()  # one parameter per bucket, reduced in the gradients themselves
    train(
        TandemDDP(m, bucket_cap_mb=0, gradient_as_bucket_view=True, timeout=CHECK_TIMEOUT_S), 3, world, rank
    )
    out["one_param_buckets_view"] = params(m)
    m = GRUNet()
    train(TandemDDP(m, timeout=CHECK_TIMEOUT_S), 3, world, rank, kind="gru")
    out["gru"] = params(m)
    m = syncbn_mlp()  # one bucket per parameter: many collectives in flight beside SyncBatchNorm's
    train(TandemDDP(m, bucket_cap_mb=0, timeout=CHECK_TIMEOUT_S), 3, world, rank)
    out["syncbn"] = params(m)
    return out


def recognizer() -> torch.nn.Module:
    """tandem train's model (tandem's parts: GRU on packed frames, sequence-wise SyncBatchNorm), small,
    float64, without dropout (whose draws are per rank)."""
    from tandem.asr.model import DeepSpeech2, ModelConfig

    torch.manual_seed(11)
    config = ModelConfig(
        n_mels=8, n_classes=6, hidden=6, layers=2, conv_channels=3, conv_kernel=(3, 3), dropout=0.0
    )
    return DeepSpeech2(config).double()


def recognizer_batch(step: int, world: int) -> tuple[torch.Tensor, ...]:
    """A global batch of 2 utterances a rank, of 9 to 40 feature frames (zeros beyond, as collate's), and
    CTC targets of 1 to 3 labels."""
    g = torch.Generator().manual_seed(2000 + step)
    n = 2 * world
    frames = torch.randint(9, 41, (n,), generator=g)
    features = torch.randn(n, 40, 8, generator=g, dtype=torch.float64)
    features *= (torch.arange(40) < frames[:, None]).unsqueeze(-1)
    target_lengths = torch.randint(1, 4, (n,), generator=g)
    targets = [torch.randint(1, 6, (int(k),), generator=g) for k in target_lengths]
    return features, frames, targets, target_lengths


def train_recognizer(model: torch.nn.Module, wrapped: torch.nn.Module, world: int, rank: int | None) -> None:
    """Three steps of tandem train's loss (the per-utterance CTC mean, summed, times the ranks over the
    global batch's utterances: DDP's average is the global mean); a rank takes utterances rank, rank +
    world, ... of each global batch, the reference (``rank`` None) all of them. SGD, not Adagrad: the
    convolution biases before batch norm have gradients of rounding noise alone (batch norm removes
    them), which Adagrad's normalisation would blow up to whole steps."""
    ctc = torch.nn.CTCLoss(blank=0, reduction="none", zero_infinity=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        features, frames, targets, target_lengths = recognizer_batch(step, world)
        pick = list(range(len(frames))) if rank is None else list(range(rank, len(frames), world))
        share = world if rank is not None else 1
        log_probs, out_frames = wrapped(features[pick], frames[pick])
        lengths = target_lengths[pick]
        losses = ctc(log_probs, torch.cat([targets[i] for i in pick]), out_frames, lengths) / lengths
        opt.zero_grad()
        (losses.sum() * share / len(frames)).backward()
        opt.step()


def _check_recognizer(rank: int, world: int) -> dict[str, Any]:
    m = recognizer()
    train_recognizer(m, TandemDDP(m, timeout=CHECK_TIMEOUT_S), world, rank)
    return {"params": params(m)}


class RaisingNet(torch.nn.Module):
    """Four layers and a head; when ``armed``, the backward raises at the output (``where`` "top": before
    any parameter's gradient) or after two layers' gradients (``"mid"``: buckets already sent)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(12)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(5, 5).double() for _ in range(4)])
        self.head = torch.nn.Linear(5, 2).double()
        self.where, self.armed = where, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if self.where == "mid" and i == 1:
                x = _Trap.apply(x, "raise" if self.armed else None)
        out = self.head(x)
        return _Trap.apply(out, "raise" if self.armed else None) if self.where == "top" else out


def _check_failed_backward(rank: int, world: int) -> dict[str, Any]:
    """A backward that raises on every rank at step 1, then steps 2 and 3: per step, what it raised (its
    type) or whether every .grad is the average of the ranks' own (all_reduce of a copy's gradients)."""
    out = {}
    for where in ("top", "mid"):
        for side, cls in (("torch", TorchDDP), ("tandem", TandemDDP)):
            model, alone = RaisingNet(where), RaisingNet(where)
            wrapper = cls(model, bucket_cap_mb=ONE_BYTE_MB)
            steps = []
            for step in range(4):
                x = torch.randn(
                    3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step + rank)
                )
                model.armed = step == 1
                model.zero_grad()
                try:
                    wrapper(x).square().mean().backward()
                except Exception as e:
                    steps.append(type(e).__name__)
                    continue
                alone.zero_grad()
                alone(x).square().mean().backward()
                expected = [p.grad / world for p in alone.parameters() if p.requires_grad]
                for g in expected:
                    dist.all_reduce(g)
                steps.append(all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), expected)))
            out[where, side] = steps
    return out


def _check_vs_torch(rank: int, world: int) -> dict[str, Any]:
    out = {}
    # Ranks start from different weights and see different data: the broadcast and averaging must fix it.
    m_t, m_d = bn_mlp(seed=2 + rank), bn_mlp(seed=2 + rank)
    ours = TandemDDP(m_t, timeout=CHECK_TIMEOUT_S)
    theirs = TorchDDP(m_d)
    train(ours, 3, world, rank)
    train(theirs, 3, world, rank)
    out["tandem"], out["torch"] = params(m_t), params(m_d)
    st = ours.stats()
    out["stats"] = {
        "backward_s": st.backward_s,
        "comm_s": st.comm_s,
        "wait_s": st.wait_s,
        "bytes_sent": st.bytes_sent,
        "buckets": st.buckets,
        "overlap": st.overlap,
        "param_bytes": sum(p.numel() * p.element_size() for p in m_t.parameters()),
    }
    out["state_dict_keys"] = (list(ours.state_dict()), list(theirs.state_dict()))
    theirs.load_state_dict(ours.state_dict())  # prefixes match: loads both ways
    ours.load_state_dict(theirs.state_dict())
    return out


def _check_no_sync(rank: int, world: int) -> dict[str, Any]:
    m_t, m_d = mlp(), mlp()
    train_no_sync(m_t, TandemDDP(m_t, timeout=CHECK_TIMEOUT_S), 2, 3, world, rank)
    train_no_sync(m_d, TorchDDP(m_d), 2, 3, world, rank)
    return {"tandem": params(m_t), "torch": params(m_d)}


def _unused_schedule(model: torch.nn.Module, ddp, rank: int, world: int) -> list[dict[str, Any]]:
    """Steps where ``c`` is used on some ranks, on none, and only under no_sync(); grads after each."""
    recorded = []
    plan = [
        (False, rank == 0),  # (no_sync micro-step using c first?, c used in the synchronised step)
        (False, False),
        (True, False),  # torch reduces what no_sync() accumulated even for a parameter unused now
        (True, rank == world - 1),
        (False, True),
    ]
    for step, (pre, use_c) in enumerate(plan):
        model.zero_grad()
        x, y = batch(step, world)
        x, y = local(x, rank, world), local(y, rank, world)
        if pre:
            with ddp.no_sync():
                loss_fn(ddp(x, True), y).backward()
        loss_fn(ddp(x, use_c), y).backward()
        recorded.append(grads(model))
    return recorded


def _check_unused(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for view in (False, True):
        m_t, m_d = Branchy(), Branchy()
        ours = TandemDDP(
            m_t, find_unused_parameters=True, gradient_as_bucket_view=view, timeout=CHECK_TIMEOUT_S
        )
        theirs = TorchDDP(m_d, find_unused_parameters=True, gradient_as_bucket_view=view)
        out[f"view={view}"] = (
            _unused_schedule(m_t, ours, rank, world),
            _unused_schedule(m_d, theirs, rank, world),
        )
    # Without find_unused_parameters an unused parameter is an error at the end of backward, on every rank;
    # a bucket per parameter, so that some were sent before it: their all-reduces may not complete into the
    # next steps (a loop that skips the failed batch and goes on got wrong gradients), which raise instead,
    # as torch's (it raises at the next forward).
    m, alone = Heads(), Heads()
    ddp = TandemDDP(m, bucket_cap_mb=ONE_BYTE_MB, timeout=CHECK_TIMEOUT_S)
    steps: list[Any] = []
    for step in range(3):
        x, y = (local(t, rank, world) for t in batch(step, world))
        m.zero_grad(set_to_none=True)
        try:
            loss_fn(ddp(x, step > 0), y).backward()
        except RuntimeError as e:
            steps.append(str(e))
            continue
        alone.zero_grad()
        loss_fn(alone(x, True), y).backward()
        expected = [p.grad / world for p in alone.parameters() if p.requires_grad]
        for g in expected:
            dist.all_reduce(g)
        got = [p.grad for p in m.parameters() if p.requires_grad]
        steps.append(all(torch.allclose(a, b) for a, b in zip(got, expected)))
    out["unused_error"], out["after_unused_error"] = steps[0], steps[1:]
    return out


def _torch_bf16_hook(state, bucket):
    # torch refuses to register its bf16 hook by name unless NCCL is there; Gloo reduces bf16 fine.
    return torch_hooks.bf16_compress_hook(state, bucket)


def _check_hooks(rank: int, world: int) -> dict[str, Any]:
    """Each hook against torch's on ranks {0, 1} (a sum of two is exact in any order, so the results
    must agree bit for bit), and tandem's hooks on the whole group."""
    out: dict[str, Any] = {}
    x, y = batch(0, world)
    x, y = local(x, rank, world).float(), local(y, rank, world).float()
    pair_group = dist.new_group([0, 1])  # every rank must take part in creating it
    pairs = {
        "fp16": (hooks.fp16_compress_hook, torch_hooks.fp16_compress_hook),
        "bf16": (hooks.bf16_compress_hook, _torch_bf16_hook),
        "allreduce": (hooks.allreduce_hook, torch_hooks.allreduce_hook),
        "torch_fp16_on_tandem": (torch_hooks.fp16_compress_hook, torch_hooks.fp16_compress_hook),
        "fp16_one_param_buckets": (hooks.fp16_compress_hook, torch_hooks.fp16_compress_hook),
    }
    if rank in (0, 1):
        for name, (ours_hook, torch_hook) in pairs.items():
            m_t, m_d = mlp(torch.float32), mlp(torch.float32)
            cap = 0 if "one_param" in name else None
            ours = TandemDDP(m_t, process_group=pair_group, bucket_cap_mb=cap, timeout=CHECK_TIMEOUT_S)
            # torch 2.11 refuses 0 ("bucket_cap_mb should be set by now"); one byte buckets the same way
            theirs = TorchDDP(m_d, process_group=pair_group, bucket_cap_mb=ONE_BYTE_MB if cap == 0 else cap)
            ours.register_comm_hook(pair_group, ours_hook)
            theirs.register_comm_hook(pair_group, torch_hook)
            loss_fn(ours(x), y).backward()
            loss_fn(theirs(x), y).backward()
            out[name] = (grads(m_t), grads(m_d), ours.stats().bytes_sent)
    for name, hook in (
        ("fp16", hooks.fp16_compress_hook),
        ("bf16", hooks.bf16_compress_hook),
        ("fp32", None),
    ):
        m = mlp(torch.float32)
        ddp = TandemDDP(m, timeout=CHECK_TIMEOUT_S)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        loss_fn(ddp(x), y).backward()
        out[f"world_{name}"] = (grads(m), ddp.stats().bytes_sent)
    m = mlp(torch.float32)
    loss_fn(m(x), y).backward()
    out["local"] = grads(m)  # this rank's own gradient, to bound the rounding of the average
    return out


class TwiceCheckpointed(torch.nn.Module):
    """One layer in two reentrant checkpoints: its gradient accumulates twice a backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(9)
        self.a, self.b, self.c = (torch.nn.Linear(6, 6).double() for _ in range(3))
        self.head = torch.nn.Linear(6, 3).double()

    def _inner(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.utils.checkpoint.checkpoint(self._inner, h, use_reentrant=True)
        h = torch.utils.checkpoint.checkpoint(self._inner, h, use_reentrant=True)
        return self.head(self.c(h))


class Boxed:
    """A forward's result that DDP cannot look into (not a tensor, tuple, dict or dataclass)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class CheckpointedHead(TwiceCheckpointed):
    """The last layer in a reentrant checkpoint, its output in a :class:`Boxed`: the first parameter
    gradient comes inside the checkpoint's own backward; the inner layer checkpointed once or twice."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.twice = twice

    def forward(self, x: torch.Tensor) -> Boxed:  # type: ignore[override]
        h = torch.utils.checkpoint.checkpoint(self._inner, self.a(x), use_reentrant=True)
        if self.twice:
            h = torch.utils.checkpoint.checkpoint(self._inner, h, use_reentrant=True)
        head = lambda t: self.head(self.c(t))
        return Boxed(torch.utils.checkpoint.checkpoint(head, h, use_reentrant=True))


def _check_static_graph_reentrant(rank: int, world: int) -> dict[str, Any]:
    """Reentrant checkpoints, three steps, tandem's and torch's DDP on the same ranks and the model alone
    on the concatenated batch: static_graph=True with a layer in two (what torch documents static_graph
    for; tandem refused it at the first step), and the outputs in an object DDP cannot look into, by
    default and with static_graph (tandem finished the reduction at the end of the checkpoint's
    backward, before the layers before it, and with static_graph counted every parameter unused)."""
    out = {}
    cases = {
        "tensor_static": (TwiceCheckpointed, {"static_graph": True}),
        "boxed": (lambda: CheckpointedHead(twice=False), {}),
        "boxed_static": (lambda: CheckpointedHead(twice=True), {"static_graph": True}),
    }
    for case, (make, kwargs) in cases.items():
        sides = (("torch", TorchDDP), ("tandem", TandemDDP), ("alone", None))
        for side, cls in sides:
            model = make()
            wrapper = model if cls is None else cls(model, **kwargs)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                x = torch.cat(
                    [
                        torch.randn(
                            4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * step + r)
                        )
                        for r in (range(world) if cls is None else [rank])
                    ]
                )
                opt.zero_grad()
                y = wrapper(x)
                y = y.tensor if isinstance(y, Boxed) else y
                loss_fn(y, torch.zeros(len(x), 3, dtype=torch.float64)).backward()
                opt.step()
            out[case, side] = params(model)
    return out


def _hooked_layouts(wrap, rank: int, world: int, steps: int = 4, **kwargs) -> list[list[list[str]]]:
    """The buckets a comm hook sees at each step (parameter names, per bucket, in launch order)."""
    m = Ordered()
    ddp = wrap(m, **kwargs)
    names = {id(p): n for n, p in m.named_parameters()}
    seen: list[list[str]] = []

    def hook(state, bucket):
        seen.append([names[id(p)] for p in bucket.parameters()])
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    layouts = []
    for step in range(steps):
        seen.clear()
        x, y = batch(step, world)
        loss_fn(ddp(local(x, rank, world)), local(y, rank, world)).backward()
        layouts.append(sorted(seen, key=len) if len(seen) > 1 else list(seen))
    return layouts


def _check_rebuild(rank: int, world: int) -> dict[str, Any]:
    m = Ordered()
    ddp = TandemDDP(m, bucket_cap_mb=0, timeout=CHECK_TIMEOUT_S)
    names = dict(zip(map(id, ddp._params), ddp._names))
    layout = lambda: [[names[id(ddp._params[i])] for i in b.members] for b in ddp._buckets]
    before = layout()
    train(ddp, 2, world, rank)
    out: dict[str, Any] = {"before": before, "after": layout(), "params": params(m)}
    # What a bucket-wise hook (PowerSGD) sees, step by step, against torch's reducer: its first layout
    # and when it re-cuts (after step 1; after step 2 with static_graph; never with find_unused_parameters)
    for mode, kwargs in (
        ("default", {}),
        ("find_unused", {"find_unused_parameters": True}),
        ("static", {"static_graph": True}),
    ):
        ours = _hooked_layouts(
            lambda mod, **kw: TandemDDP(mod, timeout=CHECK_TIMEOUT_S, **kw), rank, world, **kwargs
        )
        theirs = _hooked_layouts(TorchDDP, rank, world, **kwargs)
        out[f"hooked_{mode}"] = (ours, theirs)
    return out


def _check_mismatch(rank: int, world: int) -> dict[str, Any]:
    out = {}
    cases = {
        "shape": lambda: torch.nn.Linear(6, 9 if rank == world - 1 else 8),
        "dtype": lambda: torch.nn.Linear(6, 8).to(torch.float64 if rank == 1 else torch.float32),
        "count": lambda: torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(2 + (rank == 0))]),
        # the same values in another memory order (torch refuses it too): the buckets would sum the
        # ranks' gradients element by element in each rank's own order
        "strides": lambda: torch.nn.Conv2d(2, 4, 3).to(
            memory_format=torch.channels_last if rank == 0 else torch.contiguous_format
        ),
        # a frozen parameter's are not: it is broadcast, not reduced (torch checks only those it reduces)
        "frozen_strides": lambda: torch.nn.Sequential(
            torch.nn.Conv2d(2, 4, 3)
            .to(memory_format=torch.channels_last if rank == 0 else torch.contiguous_format)
            .requires_grad_(False),
            torch.nn.Linear(2, 2),
        ),
    }
    for name, make in cases.items():
        try:
            TandemDDP(make(), timeout=CHECK_TIMEOUT_S)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


@dataclasses.dataclass
class TwoHeads:
    """A forward's output as a dataclass (torch's DDP finds the tensors in one)."""

    a: torch.Tensor
    b: torch.Tensor


class TwoHeadNet(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.body = torch.nn.Linear(6, 8, dtype=dtype)
        # batch norm takes no complex numbers
        self.norm = torch.nn.Identity() if dtype.is_complex else torch.nn.BatchNorm1d(8, dtype=dtype)
        self.a = torch.nn.Linear(8, 3, dtype=dtype)
        self.b = torch.nn.Linear(8, 3, dtype=dtype)

    def forward(self, x: torch.Tensor) -> TwoHeads:
        h = self.norm(torch.tanh(self.body(x.to(self.body.weight.dtype))))
        return TwoHeads(self.a(h), self.b(h))


def _two_head_step(wrapper, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    out = wrapper(x)
    (loss_fn(out.a.real, y) + loss_fn(out.b.imag if out.b.is_complex() else out.b, y)).backward()
    return {"grads": grads(model), "buffers": {k: v.clone() for k, v in model.named_buffers()}}


def _check_drop_in(rank: int, world: int) -> dict[str, Any]:
    """What a torch user's DDP code does, wrapped by torch's and by tandem's: dataclass outputs with
    find_unused_parameters, broadcast_buffers=False (each rank's own buffers from the start),
    parameters left rank-local by _set_params_and_buffers_to_ignore_for_model, complex parameters,
    torch's positional order, bucket_cap_mb_list, and the timeout the group was made with."""
    x, y = batch(0, world)
    x, y = local(x, rank, world), local(y, rank, world)
    out: dict[str, Any] = {}
    cases = {
        "dataclass": (dict(find_unused_parameters=True), torch.float64, None),
        "own_buffers": (dict(broadcast_buffers=False), torch.float64, None),
        "ignored": ({}, torch.float64, ["a.bias", "norm.running_mean"]),
        "complex": ({}, torch.complex128, None),
        "positional": ((None, None, 0, True, True, None, ONE_BYTE_MB), torch.float64, None),
        "cap_list": (dict(bucket_cap_mb_list=[ONE_BYTE_MB, 1.0]), torch.float64, None),
    }
    if "bucket_cap_mb_list" not in inspect.signature(TorchDDP.__init__).parameters:
        del cases["cap_list"]  # torch 2.11's DDP has none
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13's about broadcast_buffers
        for name, (args, dtype, ignore) in cases.items():
            for side, cls in (("torch", TorchDDP), ("tandem", TandemDDP)):
                model = TwoHeadNet(dtype)
                with torch.no_grad():
                    if not dtype.is_complex:
                        model.norm.running_mean.fill_(float(rank))  # a rank's own statistics
                    model.a.bias.add_(rank)  # differs per rank: kept only where it is ignored
                if ignore is not None:
                    cls._set_params_and_buffers_to_ignore_for_model(model, ignore)
                wrapper = cls(model, *args) if isinstance(args, tuple) else cls(model, **args)
                out[f"{name}_{side}"] = _two_head_step(wrapper, model, x, y)
    ddp = TandemDDP(mlp(), init_sync=False)
    out["default_timeout"] = ddp.timeout
    # copies of a trained wrapper (an EMA copy, a checkpoint of the whole wrapper): each trains on,
    # averaging over the default group, as torch's copies do; the original goes on too
    for side, cls in (("torch", TorchDDP), ("tandem", TandemDDP)):
        model = mlp()
        wrapper = cls(model)
        train(wrapper, 1, world, rank)
        copies = {"deepcopy": copy.deepcopy(wrapper)}
        buffer = io.BytesIO()
        torch.save(wrapper, buffer)
        buffer.seek(0)
        copies["torch_save"] = torch.load(buffer, weights_only=False)
        for name, twin in copies.items():
            train(twin, 2, world, rank)
            out[f"copy_{name}_{side}"] = params(twin.module)
        train(wrapper, 1, world, rank)
        out[f"copy_original_{side}"] = params(model)
    return out


class ChannelsLastNet(torch.nn.Module):
    """A channels_last convolution and a transposed weight (strides (1, 4)): parameters whose bucket views
    are not row-major; a batch norm whose buffers a forward's graph saves."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.conv = torch.nn.Conv2d(2, 4, 3).double().to(memory_format=torch.channels_last)
        self.norm = torch.nn.BatchNorm2d(4).double()
        self.t = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64).t())  # [3, 4], strides (1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(x)).mean((2, 3))  # [B, 4]
        return h @ self.t.t()


def _clip(param: torch.Tensor) -> None:
    param.grad.clamp_(-0.01, 0.01)


def _own_result_hook(state, bucket):
    """A hook whose future gives a tensor of its own (a decompressed one, say), not the bucket's buffer."""
    reduced = bucket.buffer().clone() / dist.get_world_size()
    work = dist.all_reduce(reduced, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _check_layouts_and_user_hooks(rank: int, world: int) -> dict[str, Any]:
    """What a helper's hunt found, each against torch's DDP on the same ranks: a hook's result of its own
    for channels_last and transposed parameters (read row-major: wrong gradients), PowerSGD on them
    (gradients() views PowerSGD could not view(n, -1)), a post-accumulate-grad hook registered after
    wrapping (ignored: the average was written over its change), two forwards before one backward with
    buffers (refused as modified in place), PowerSGD's state naming the default group beside
    SyncBatchNorm (a deadlock), and the hooks on an output that is a parameter (one more a step)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(3, 2, 6, 6, dtype=torch.float64, generator=gen) for _ in range(4)]

    def run(case: str, cls: type) -> dict[str, Any]:
        if case in ("powersgd_syncbn", "own_result_syncbn"):
            # PowerSGD's first steps (start_powerSGD_iter, 10 by default) all-reduce the buckets as they
            # are, on the default group; compressed, several buckets hang torch's DDP on Gloo too
            torch.manual_seed(8)
            sbn, linear, relu = tandem.nn.SyncBatchNorm, torch.nn.Linear, torch.nn.ReLU
            layers = [linear(8, 32), sbn(32), relu(), linear(32, 32), sbn(32), relu(), linear(32, 4)]
            model = torch.nn.Sequential(*layers)
            wrapper = cls(model, bucket_cap_mb=0.001)
            if case == "powersgd_syncbn":
                state = powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=1000)
                wrapper.register_comm_hook(state, powersgd.powerSGD_hook)
            else:  # a hook that ignores its state: its all-reduce is on the default group
                wrapper.register_comm_hook(None, _own_result_hook)
            steps = torch.Generator().manual_seed(rank)
            for _ in range(4):
                model.zero_grad()
                wrapper(torch.randn(16, 8, generator=steps)).square().sum().backward()
            return {"grads": grads(model), "buffers": dict(model.named_buffers())}
        model = ChannelsLastNet()
        wrapper = cls(model, bucket_cap_mb=ONE_BYTE_MB if case == "own_result" else 25)
        if case == "own_result":
            wrapper.register_comm_hook(None, _own_result_hook)
        elif case == "powersgd":
            state = powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
            wrapper.register_comm_hook(state, powersgd.powerSGD_hook)
        elif case == "clip_after":
            for param in model.parameters():
                param.register_post_accumulate_grad_hook(_clip)
        for step in range(3):
            model.zero_grad()
            if case == "two_forwards":
                (wrapper(xs[step]).square().sum() + wrapper(xs[step + 1]).sum()).backward()
            else:
                wrapper(xs[step]).square().sum().backward()
        return {"grads": grads(model), "buffers": dict(model.named_buffers())}

    cases = ("own_result", "powersgd", "clip_after", "two_forwards", "powersgd_syncbn", "own_result_syncbn")
    for case in cases:
        for side, cls in (("torch", TorchDDP), ("tandem", TandemDDP)):
            try:
                out[f"{case}_{side}"] = run(case, cls)
            except Exception:  # the same on every rank: the next case's collectives still match
                out[f"{case}_{side}"] = {"error": traceback.format_exc()}
    model = ScaleAndWeight()
    wrapper = TandemDDP(model)
    for step in range(5):
        scaled, weight = wrapper(xs[step % 4])
        (scaled.sum() + weight.sum()).backward()
    out["leaf_hooks"] = len(model.w._backward_hooks or {})
    return out


class ScaleAndWeight(torch.nn.Module):
    """A forward that returns its parameter as it is (a leaf output)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.w, self.w


def _check_many_wrappers(rank: int, world: int) -> dict[str, Any]:
    """Wrappers made, trained a step and dropped one after another (a search over settings, folds): the
    threads and open files of the process after 3 and after 23 of them, and each one's gradients."""
    import gc
    import os

    def resources() -> tuple[int, int]:
        gc.collect()
        return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))  # threads, files

    seen, right = {}, True
    for k in range(23):
        torch.manual_seed(k)
        model = torch.nn.Linear(4, 2, dtype=torch.float64)
        ddp = TandemDDP(model, timeout=CHECK_TIMEOUT_S)
        x = torch.full((3, 4), float(rank + 1), dtype=torch.float64)
        ddp(x).sum().backward()
        # each rank's 3 rows of rank + 1: the average of 3 (r + 1) over the ranks
        right &= torch.allclose(model.weight.grad, torch.full((2, 4), 1.5 * (world + 1), dtype=torch.float64))
        del ddp, model
        if k + 1 in (3, 23):
            seen[k + 1] = resources()
    return {"seen": seen, "right": right}


MAIN_CHECKS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "single_process": _check_single_process,
    "recognizer": _check_recognizer,
    "failed_backward": _check_failed_backward,
    "vs_torch": _check_vs_torch,
    "no_sync": _check_no_sync,
    "unused": _check_unused,
    "hooks": _check_hooks,
    "rebuild": _check_rebuild,
    "mismatch": _check_mismatch,
    "drop_in": _check_drop_in,
    "static_graph_reentrant": _check_static_graph_reentrant,
    "layouts_and_user_hooks": _check_layouts_and_user_hooks,
    "many_wrappers": _check_many_wrappers,
}


def scenario_main(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {"seconds": {}}  # each check's time, for a failure's report
    for name, check in MAIN_CHECKS.items():
        start = time.monotonic()
        try:
            results[name] = check(rank, world)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            if isinstance(results[name], dict) and "CommunicationError" in results[name]["error"]:
                break  # the group is broken: the later checks would only time out
        finally:
            results["seconds"][name] = round(time.monotonic() - start, 1)
    return results


# ----------------------------------------------------------------------------------------------
# failure scenarios: a rank dies or hangs in the middle of backward


class _Trap(torch.autograd.Function):
    """Identity whose backward kills (``"kill"``) or stalls (``"stall"``) this rank, or raises
    (``"raise"``)."""

    @staticmethod
    def forward(ctx, x, action):
        ctx.action = action
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif ctx.action == "stall":
            time.sleep(120)
        elif ctx.action == "raise":
            raise ValueError("raised in backward")
        return g, None


class Trapped(torch.nn.Module):
    def __init__(self, action: str | None) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.bottom = torch.nn.Linear(6, 64)
        self.top = torch.nn.Linear(64, 3)
        self.action = action

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bottom(x))
        if self.action is not None:
            h = _Trap.apply(h, self.action)
        return self.top(h)


def scenario_failure(rank: int, world: int, victim: int, action: str, timeout: float) -> dict[str, Any]:
    model = Trapped(None)
    ddp = TandemDDP(model, bucket_cap_mb=0, timeout=timeout)
    x = torch.randn(LOCAL_BATCH, 6)
    ddp(x).sum().backward()  # one healthy step: buckets rebuilt, everyone alive
    model.action = action if rank == victim else None
    out: dict[str, Any] = {"error": None}
    start = time.monotonic()
    try:
        ddp(x).sum().backward()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["elapsed"] = time.monotonic() - start
    try:  # the wrapper remembers: the next step fails at once instead of waiting again
        start = time.monotonic()
        ddp(x)
        out["next_forward"] = None
    except Exception as e:
        out["next_forward"] = f"{type(e).__name__}: {e}"
    out["next_elapsed"] = time.monotonic() - start
    return out


# ----------------------------------------------------------------------------------------------
# uneven inputs: join(), against torch's DDP under the same schedules


UseC = Callable[[int, int], bool] | None  # Branchy's forward: whether rank r uses c at step s


# name -> (model, DDP options, join options, steps of rank r, the micro-steps under no_sync() per step,
# when Branchy's c is used)
JOIN_CASES: dict[str, tuple[Callable[[], torch.nn.Module], dict, dict, Callable[[int], int], int, UseC]] = {
    "default": (mlp, {}, {}, lambda r: 2 + r, 0, None),
    "divide_by_nonjoined": (mlp, {}, {"divide_by_initial_world_size": False}, lambda r: 2 + r, 0, None),
    "buffers": (bn_mlp, {}, {}, lambda r: 4 - r, 0, None),  # rank 0, whose buffers lead, joins last
    "one_param_buckets": (mlp, {"bucket_cap_mb": ONE_BYTE_MB}, {}, lambda r: 1 + 2 * r, 0, None),
    "unused": (
        Branchy,
        {"find_unused_parameters": True},
        {},
        lambda r: 2 + r,
        0,
        lambda r, s: r == 0 and s % 2 == 0,
    ),
    # c used by rank 1 alone in the last step rank 0 trains, then by none: torch's joined rank goes on
    # sending that step's reduced used map, so c counts as used (zeros averaged in) afterwards
    "unused_after_join": (
        Branchy,
        {"find_unused_parameters": True},
        {},
        lambda r: 2 + r,
        0,
        lambda r, s: r == 1 and s == 1,
    ),
    "no_sync": (mlp, {}, {}, lambda r: 2 + r, 1, None),
    "rank_without_data": (Ordered, {}, {}, lambda r: 0 if r == 1 else 3, 0, None),
    # torch's own all-reduce hook on both wrappers: a joined rank sends it buckets of zeros
    "comm_hook": (mlp, {"hook": torch_hooks.allreduce_hook}, {}, lambda r: 2 + r, 0, None),
}


def _join_run(
    wrapper,
    model,
    join_options: dict,
    steps: int,
    micro: int,
    use_c: UseC,
    rank: int,
    world: int,
    evaluate: bool = False,
):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with wrapper.join(**join_options):
        for step in range(steps):
            if evaluate:  # a forward without grad (validation): no backward follows
                with torch.no_grad():
                    wrapper(local(batch(99, world)[0], rank, world))
            opt.zero_grad()
            for k in range(micro + 1):
                x, y = batch(10 * step + k, world)
                x, y = local(x, rank, world), local(y, rank, world)
                args = (x, use_c(rank, step)) if use_c is not None else (x,)
                with wrapper.no_sync() if k < micro else _nullcontext():
                    loss_fn(wrapper(*args), y).backward()
            opt.step()
    return params(model)


class _Counter(Joinable):
    """A Joinable of the user's own (torch's Join tutorial): counts the ranks still going at each step."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def step(self) -> None:
        Join.notify_join_context(self)
        ones = torch.ones(1)
        dist.all_reduce(ones)
        self.count += int(ones.item())

    def join_hook(self, **kwargs: Any) -> JoinHook:
        counter = self

        class Hook(JoinHook):
            def main_hook(self) -> None:
                zeros = torch.zeros(1)
                dist.all_reduce(zeros)
                counter.count += int(zeros.item())

        return Hook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD


def _join_with_a_counter_first(wrap, rank: int, world: int) -> dict[str, Any]:
    """``Join([counter, ddp])``: the user's Joinable first, the wrapper's group compared with its own."""
    model = mlp()
    wrapper = wrap(model, **({"timeout": CHECK_TIMEOUT_S} if wrap is TandemDDP else {}))
    counter = _Counter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Join([counter, wrapper]):
        for step in range(2 + rank):
            counter.step()
            opt.zero_grad()
            x, y = batch(step, world)
            loss_fn(wrapper(local(x, rank, world)), local(y, rank, world)).backward()
            opt.step()
    return {
        "params": params(model),
        "count": counter.count,
        "group_is_world": wrapper.process_group is dist.group.WORLD,
    }


def scenario_join(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (make, ddp_options, join_options, steps, micro, use_c) in JOIN_CASES.items():
        try:
            runs = {}
            for label, wrap in (("tandem", TandemDDP), ("torch", TorchDDP)):
                model = make()
                extra = {"timeout": CHECK_TIMEOUT_S} if wrap is TandemDDP else {}
                options = dict(ddp_options)
                hook = options.pop("hook", None)
                wrapper = wrap(model, **options, **extra)
                if hook is not None:
                    wrapper.register_comm_hook(None, hook)
                runs[label] = _join_run(wrapper, model, join_options, steps(rank), micro, use_c, rank, world)
            out[name] = runs
        except Exception:
            out[name] = {"error": traceback.format_exc()}
            break  # the ranks are out of step: the later cases would only time out
    # a forward without grad inside the join (torch's DDP would have the joined ranks wait for its
    # backward): the same model as torch's without it
    model = mlp()
    wrapper = TandemDDP(model, timeout=CHECK_TIMEOUT_S)
    evaluated = _join_run(wrapper, model, {}, 2 + rank, 0, None, rank, world, evaluate=True)
    out["evaluate"] = {"tandem": evaluated, "torch": out["default"]["torch"]}
    out["joinable_first"] = {
        label: _join_with_a_counter_first(wrap, rank, world)
        for label, wrap in (("tandem", TandemDDP), ("torch", TorchDDP))
    }
    # throw_on_early_termination: every rank raises once the first runs out, with torch's error
    errors = {}
    for label, wrap in (("tandem", TandemDDP), ("torch", TorchDDP)):
        model = mlp()
        wrapper = wrap(model, **({"timeout": CHECK_TIMEOUT_S} if wrap is TandemDDP else {}))
        try:
            _join_run(wrapper, model, {"throw_on_early_termination": True}, 2 + rank, 0, None, rank, world)
            errors[label] = None
        except RuntimeError as e:
            errors[label] = type(e).__name__
    out["throw"] = errors
    return out


SCENARIOS = {"main": scenario_main, "failure": scenario_failure, "join": scenario_join}


def entry(rank: int, world: int, store: str, result_dir: str, scenario: str, options: dict[str, Any]) -> None:
    """Process entry point: run ``scenario`` as ``rank`` and save what it returns (or its error)."""
    try:
        join_group(rank, world, store)
        result = SCENARIOS[scenario](rank, world, **options)
    except Exception:
        result = {"fatal": traceback.format_exc()}
    torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    # No process-group teardown: after a peer died it could block; the test reads the file.
    os._exit(0)
