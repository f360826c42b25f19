"""What tandem.nn.GRU and tandem.nn.LSTM share around their ops: input forms, weights, checks, outputs."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from tandem._backend import use_triton
from tandem.nn._fx import ours, runs_own_forward
from tandem.ops._recompute import mutation_allowed, needs_autograd_ops, transformed, versions_unchanged

__all__ = ["Rows", "RNNLayers", "needs_formulas"]


# What torch's autocast wrapper of cuDNN's RNNs casts to float16 (its cached_cast: floating, not float64).
_AUTOCAST_CAST = (torch.float32, torch.bfloat16, torch.float16)


def needs_formulas(batch: int, *tensors: Tensor | None) -> bool:
    """Whether a layer runs as autograd-tracked PyTorch ops with torch's formulas (what
    :mod:`tandem.ops._recompute` differentiates) instead of the kernels' custom ops, whose hand-written
    backward serves reverse-mode autograd on real numbers only: an empty batch (``batch`` 0), complex
    numbers, forward-mode AD (a tangent on any of ``tensors``) and torch.func's transforms. As torch's
    own layers there, slower and with the same values."""
    complex_numbers = any(t is not None and t.is_complex() for t in tensors)
    return batch == 0 or complex_numbers or needs_autograd_ops(*tensors)


def _in_onnx_export() -> bool:
    """Whether torch.onnx.export is tracing the call, either exporter: the TorchScript one (``dynamo=False``)
    or torch.export's (``dynamo=True``, whose first try, non-strict, runs the Python forward). Its graph
    then takes torch's own forward, whose RNN ops ONNX has symbolics for (it has none for tandem's custom
    ops, nor for the oneDNN layer tandem's LSTM calls), so that a tandem layer exports as torch's does, or
    fails with its error. Without ``torch.onnx`` imported no export runs, and the first call of its flag
    would import it (milliseconds); under Dynamo (torch.compile, strict torch.export) the flag is False,
    as Dynamo folds torch's own."""
    if torch.compiler.is_dynamo_compiling():
        return False
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and onnx.is_in_onnx_export()


@dataclass
class Rows:
    """An input as the ops take it: packed rows ``[P, I]`` and ``batch_sizes``, plus how to undo it."""

    data: Tensor
    batch_sizes: Tensor | None  # None until ``to_rows`` fills it for a padded input
    mini_batch: int
    packed: bool
    batched: bool = True
    batch_dim: int = 1
    sorted_indices: Tensor | None = None
    unsorted_indices: Tensor | None = None
    checked: Tensor | None = None  # what torch's check_forward_args looks at (input or packed data)
    given_batch_sizes: Tensor | None = None  # a PackedSequence's own, where ``batch_sizes`` drops its 0s
    # ``batch_sizes`` as Python ints, for a padded input (known from its shape)
    step_sizes: list[int] | None = None


# What TorchScript reads off a module's class besides its methods: merged from a subclass's classes
_SCRIPT_LISTS = ("__constants__", "__jit_unused_properties__", "__jit_ignored_attributes__")


class RNNLayers(torch.nn.RNNBase):
    """``torch.nn.RNNBase`` plus the plumbing of a packed-rows RNN module; subclasses own the hidden state."""

    _GATES: int  # gate blocks in the weights: 3 (GRU), 4 (LSTM)

    def _weights_without_caching(self) -> dict[str, Tensor]:
        """What :meth:`_current_weights` reads from the refreshed cache, computed as torch's refresh
        (its ``_weights_have_changed``, then ``_init_flat_weights``'s reads) computes it, each weight
        evaluated as many times (a parametrization such as ``spectral_norm`` steps its power iteration at
        each), without writing the cache: under torch.compile the tensors may be functorch's wrappers
        (``torch.func.grad`` over ``functional_call``), whose storing on the module made the compile fail
        (torch's own layers are not traced)."""
        names = self._flat_weights_names
        if self._weights_have_changed():
            return {n: getattr(self, n) if hasattr(self, n) else None for n in names}
        return dict(zip(names, self._flat_weights))

    def _current_weights(self) -> dict[str, Tensor]:
        """The weights by name, as torch's forward takes them: its cache refreshed first
        (``_update_flat_weights``), so that ``torch.func.functional_call``'s tensors are seen and a
        parametrization (``spectral_norm`` on ``weight_hh_l0``) runs as many times a forward as in
        torch's. Attributes changed after construction that no longer describe the weights
        (``num_layers``, ``bidirectional``, ``bias``, ``hidden_size``, ``proj_size``, ``input_size``)
        are a RuntimeError, as in torch's GRU (whose LSTM raises or computes with what it finds)."""
        if torch.compiler.is_compiling():
            weights = self._weights_without_caching()
        else:
            self._update_flat_weights()
            weights = dict(zip(self._flat_weights_names, self._flat_weights))
        gates = self._GATES * self.hidden_size
        out = self.proj_size or self.hidden_size
        suffixes = ("", "_reverse") if self.bidirectional else ("",)
        expected: dict[str, tuple[int, ...]] = {}
        for layer in range(self.num_layers):
            width = self.input_size if layer == 0 else len(suffixes) * out
            for s in suffixes:
                expected[f"weight_ih_l{layer}{s}"] = (gates, width)
                expected[f"weight_hh_l{layer}{s}"] = (gates, out)
                if self.bias:
                    expected[f"bias_ih_l{layer}{s}"] = (gates,)
                    expected[f"bias_hh_l{layer}{s}"] = (gates,)
                if self.proj_size:
                    expected[f"weight_hr_l{layer}{s}"] = (self.proj_size, self.hidden_size)
        for name in dict.fromkeys([*expected, *weights]):
            want = expected.get(name)
            got = weights.get(name)
            if want is not None and name in weights and got is None:  # set to None: torch's op's TypeError
                raise TypeError(f"{self.mode}: expected a Tensor for {name}, got None")
            if want is None or got is None or tuple(got.shape) != want:
                settings = ", ".join(
                    f"{k}={getattr(self, k)}"
                    for k in ("input_size", "hidden_size", "num_layers", "bias", "bidirectional", "proj_size")
                    if k != "proj_size" or self.mode == "LSTM"
                )
                raise RuntimeError(
                    f"{self.mode}: the module's settings ({settings}) do not describe its weights: "
                    f"{name} should {'not exist' if want is None else f'have shape {list(want)}'}, "
                    f"{'it is missing' if got is None else f'it has {list(got.shape)}'} (were the settings "
                    "changed after construction? make a new module instead)"
                )
        return weights

    def _layer_weights(
        self,
        weights: dict[str, Tensor],
        layer: int,
        names: tuple[str, ...],
        dtype: torch.dtype | None = None,
        input_requires_grad: bool = True,
        frozen: list[Callable[[Tensor], None]] | None = None,
        state_requires_grad: bool = True,
    ) -> tuple[Tensor | None, ...]:
        """The layer's parameters ``names`` (of ``weights``, :meth:`_current_weights`) stacked over
        directions (``[D, ...]``, a copy), None where absent; cast to ``dtype`` if given (autocast: the
        gradients flow back to the parameters' dtype).

        A parameter changed in place between this forward and its backward (an ``optimizer.step()``
        before ``backward()``) makes that backward raise autograd's "modified by an inplace operation"
        RuntimeError exactly where torch's layers raise it, the parameters torch's ops save: the
        recurrent weights if a state they multiply requires grad (``state_requires_grad``: False where
        torch's own cell takes one step from an h0 without grad), the projection weights, and the input
        weights if the layer's input requires grad; never the biases. The ops save their copies, so the
        parameters' versions are checked by a hook: on the copy's gradient, or, for a parameter that
        needs none (frozen), one of the checks added to ``frozen`` that :meth:`_check_frozen_in_backward`
        hooks on the layer's outputs.
        """
        suffixes = ("", "_reverse") if self.bidirectional else ("",)
        stacked: list[Tensor | None] = []
        for name in names:
            if (name.startswith("bias") and not self.bias) or (name == "weight_hr" and not self.proj_size):
                stacked.append(None)
                continue
            per_direction = [weights[f"{name}_l{layer}{s}"] for s in suffixes]
            if len(suffixes) == 1:
                weight = per_direction[0].unsqueeze(0)
                weight = weight.clone() if dtype is None or dtype == weight.dtype else weight.to(dtype)
            else:
                weight = torch.stack(per_direction)
                weight = weight if dtype is None else weight.to(dtype)
            saved = {"weight_ih": input_requires_grad, "weight_hh": state_requires_grad, "weight_hr": True}
            if saved.get(name, False):
                self._check_versions_in_backward(
                    weight, per_direction, [f"{name}_l{layer}{s}" for s in suffixes], frozen
                )
            stacked.append(weight)
        return tuple(stacked)

    def _check_versions_in_backward(
        self,
        copy: Tensor,
        originals: list[Tensor],
        names: list[str],
        frozen: list[Callable[[Tensor], None]] | None = None,
    ) -> None:
        """Raise autograd's in-place error in the backward through ``copy`` if one of ``originals`` (the
        parameters it was made from) has changed in place since now: a hook on ``copy``'s gradient, or
        where it needs none (frozen parameters: torch's ops save them all the same), the check added to
        ``frozen``."""
        if not torch.is_grad_enabled() or transformed() or mutation_allowed():
            return
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return
        if not copy.requires_grad and frozen is None:
            return
        try:
            versions = [t._version for t in originals]
        except RuntimeError:  # inference tensors keep no version
            return
        named = [f"{self.mode}'s {name}" for name in names]
        hint = ": an optimizer.step() before backward?"
        check = functools.partial(versions_unchanged, originals, named, versions, hint)
        if copy.requires_grad:
            copy.register_hook(check)
        else:
            frozen.append(check)

    def _one_step(self, rows: Rows) -> bool:
        """Whether the input has one time step, where torch's own cell (not oneDNN's) multiplies W_hh by h0
        alone and saves W_hh only if h0 requires grad (see :meth:`_layer_weights`); a PackedSequence's steps
        as given, as torch runs a step of batch 0 too, on a state with grad. False where no copy matters."""
        steps = rows.batch_sizes if rows.given_batch_sizes is None else rows.given_batch_sizes
        return self._copies_may_matter() and steps.shape[0] == 1

    @staticmethod
    def _copies_may_matter() -> bool:
        """Whether a copy of what an op saves (:meth:`_unsaved`, LSTM's ``_unsaved_c0``) can matter: grad
        mode on and eager (torch.compile and jit.trace record what the op saves themselves)."""
        return torch.is_grad_enabled() and not torch.compiler.is_compiling() and not torch.jit.is_tracing()

    @staticmethod
    def _unsaved(
        x: Tensor, h0: Tensor, w_ih: Tensor, w_hh: Tensor, *others: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """``x`` and ``h0`` as a layer's op takes them: a copy of one that only a frozen weight's gradient
        would read (``x`` for the input weights', ``h0`` for the recurrent ones'). torch's layers save
        them for those gradients alone (autograd's products), so their callers may change them in place
        before backward where no weight needs a gradient (input saliency on a frozen model, a learned
        initial state); tandem's ops save their inputs whatever reads them, and raised autograd's error."""
        if not RNNLayers._copies_may_matter():
            return x, h0
        if not any(t is not None and t.requires_grad for t in (x, h0, w_ih, w_hh, *others)):
            return x, h0  # no backward will run
        return (x if w_ih.requires_grad else x.clone()), (h0 if w_hh.requires_grad else h0.clone())

    @staticmethod
    def _check_frozen_in_backward(
        outputs: tuple[Tensor, ...], frozen: list[Callable[[Tensor], None]]
    ) -> None:
        """The checks of :meth:`_layer_weights`'s frozen parameters, run when a gradient of the layer's
        ``outputs`` (output, final states) is computed: the layer's backward follows."""
        for out in outputs:
            if out.requires_grad:
                for check in frozen:
                    out.register_hook(check)

    def _dispatch(self, input: Tensor | PackedSequence, hx: Any) -> Any:
        """The forward: torch's own where tandem's kernels do not take the call; under autocast on the
        Triton path (:meth:`_autocast_dtype`) the subclass's ``_forward`` with autocast off throughout, its
        tensors cast on the way in, as torch's autocast wrapper of ``_cudnn_rnn`` casts and then excludes
        autocast: the concatenation of the layers' states and the formulas of an empty batch or of
        torch.func compute in that dtype too, not in autocast's own (which failed or gave float32)."""
        if self._settings_torch_refuses() or self._under_cpu_autocast(input) or _in_onnx_export():
            # torch's error, torch's mixed-precision numbers, or (ONNX has no tandem ops) torch's graph
            return self._torch_forward(input, hx)
        data = input[0] if isinstance(input, PackedSequence) else input
        dtype = self._autocast_dtype(data) if isinstance(data, Tensor) else None
        if dtype is None:
            return self._forward(input, hx, None)
        with torch.autocast(data.device.type, enabled=False):
            return self._forward(input, hx, dtype)

    def _settings_torch_refuses(self) -> bool:
        """Settings set after construction (or given positionally) that torch's op refuses: a flag that is
        not a bool (``m.batch_first = 0``: its TypeError), a GRU with a ``proj_size`` (the constructor
        refuses only the keyword; every forward raises), sizes that are not ints (``num_layers=True``: its
        op's TypeError; an ``input_size`` of 3.0, which its forward compares and takes). tandem's kernels
        would read them as true or false, or as numbers: torch's own forward runs, for its error or its
        result."""
        flags = (self.bidirectional, self.batch_first, self.bias, self.training)
        if not all(isinstance(f, bool) for f in flags) or not isinstance(self.proj_size, int):
            return True
        if not all(type(n) is int for n in (self.num_layers, self.input_size, self.hidden_size)):
            return True
        return self.mode != "LSTM" and self.proj_size != 0

    @staticmethod
    def _as_called(dtype: torch.dtype | None, data: Tensor) -> contextlib.AbstractContextManager:
        """Around torch's own input check inside :meth:`_dispatch`'s autocast-off forward: autocast on
        again where the call came under it (``dtype`` given), since torch's check then lets an input
        whose dtype is not the weights' through."""
        return contextlib.nullcontext() if dtype is None else torch.autocast(data.device.type, dtype=dtype)

    @staticmethod
    def _under_cpu_autocast(input: Tensor | PackedSequence) -> bool:
        """Whether ``input`` goes to tandem's plain-PyTorch CPU kernel under CPU autocast. torch's CPU
        layers then run their matrix products in the autocast dtype (and take inputs and parameters of
        mixed dtypes), which that kernel does not: these calls run torch's own forward, for torch's
        numbers. (Under Triton's interpreter, CPU tensors take the Triton kernels and autocast's
        meaning for them: :meth:`_autocast_dtype`.)"""
        data = input[0] if isinstance(input, PackedSequence) else input
        return (
            isinstance(data, Tensor)
            and data.device.type == "cpu"
            and torch.is_autocast_enabled("cpu")
            and not use_triton(data)
        )

    @staticmethod
    def _autocast_dtype(data: Tensor) -> torch.dtype | None:
        """The dtype the layers run in under autocast, or None for the input's own dtype.

        Where tandem runs its Triton kernels (CUDA), autocast makes the layers run in float16, whatever
        autocast's own dtype, as it does torch's cuDNN RNNs (torch's autocast wrapper of ``_cudnn_rnn``
        casts to half): float32, bfloat16 and float16 inputs, their states and the weights are cast on the
        way in, and the gradients flow back in the parameters' dtype. float64 is never cast. (On the CPU
        under CPU autocast the layers are torch's own: :meth:`_under_cpu_autocast`.)
        """
        device = data.device.type
        if data.dtype not in _AUTOCAST_CAST or not use_triton(data) or not torch.is_autocast_enabled(device):
            return None
        return torch.float16

    @staticmethod
    def _autocast_state(state: Tensor, dtype: torch.dtype | None) -> Tensor:
        """A state as autocast leaves it (see :meth:`_autocast_dtype`): cast unless float64."""
        return state if dtype is None or state.dtype not in _AUTOCAST_CAST else state.to(dtype)

    def _torch_forward(self, input: Tensor | PackedSequence, hx: Any) -> Any:
        """torch.nn.GRU's or LSTM's own forward on this module (its parameters and checks are torch's):
        for settings tandem's kernels do not take and torch's forward rejects, so that the error is
        torch's own (a non-bool ``bidirectional``, which torch's constructor lets through), for CPU
        autocast, and under torch.onnx.export (:func:`_in_onnx_export`)."""
        return getattr(torch.nn, self.mode).forward(self, input, hx)

    def __prepare_scriptable__(self) -> torch.nn.Module:
        """What ``torch.jit.script`` compiles in this module's place: the same module seen as torch's
        GRU or LSTM (one state shared: parameters, settings, hooks, parametrizations), whose forward
        TorchScript can compile (tandem's kernels and autograd functions it cannot). The scripted module
        computes and trains as torch's. As with every ``__prepare_scriptable__``, torch.jit.script puts
        what this returns into the scripted model's original too (its parent's submodules): that model
        then runs torch's forward there, with the same numbers.

        A subclass with a forward of its own has it compiled, with the rest of its classes' (and mixins')
        methods, attributes and annotations, on a subclass of torch's class: as TorchScript compiles a
        subclass of torch's layer (torch's forward ran in its place). torch.nn.utils.parametrize's
        properties come along too."""
        torch_cls = getattr(torch.nn, self.mode)
        mro = type(self).__mro__
        own: dict[str, Any] = {}
        if runs_own_forward(self):
            first: dict[str, tuple[type, Any]] = {}  # each name as the class that resolves it defines it
            for c in mro:
                for name, value in vars(c).items():
                    first.setdefault(name, (c, value))
            own = {k: v for k, (c, v) in first.items() if not ours(c) and not k.startswith("__")}
            annotations: dict[str, Any] = {}
            lists = {k: list(getattr(torch_cls, k, [])) for k in _SCRIPT_LISTS}
            for c in reversed([c for c in mro if not ours(c)]):  # the more derived class's wins
                annotations.update(vars(c).get("__annotations__", {}))
                for k, names in lists.items():
                    names += [n for n in vars(c).get(k, []) if n not in names]
            own.update(lists, __annotations__=annotations)
        if type(self).__module__ == "torch.nn.utils.parametrize":  # its class of a parametrized module
            own.update((k, v) for k, v in vars(type(self)).items() if isinstance(v, property))
        cls: type = type(type(self).__name__, (torch_cls,), own) if own else torch_cls
        twin = cls.__new__(cls)
        twin.__dict__ = self.__dict__
        return twin

    def _take_input(self, input: Tensor | PackedSequence) -> Rows:
        """Unpack a PackedSequence, or check a padded input's dims and unsqueeze an unbatched one."""
        if isinstance(input, PackedSequence):
            data, batch_sizes, sorted_indices, unsorted_indices = input
            given = batch_sizes
            if not torch.compiler.is_compiling():
                batch_sizes = self._checked_batch_sizes(data, batch_sizes)
            if sorted_indices is not None and torch.compiler.is_compiling():
                # the number of sequences as a shape: reading batch_sizes[0] would break torch.compile's
                # graph here, and across a break dynamo cannot rebuild a PackedSequence the caller made
                # with _replace (torch 2.13); eager reads it, as torch's layers do
                mini_batch = sorted_indices.shape[0]
            else:
                mini_batch = int(batch_sizes[0])
                if torch.compiler.is_compiling():
                    # data to torch.compile (sorted input has no sorted_indices to take it from): a packed
                    # batch holds a sequence, as eager's check of batch_sizes makes sure, which the trace
                    # must be told for the tests of an empty batch (a fullgraph compile failed on them)
                    torch._check(mini_batch > 0)
            return Rows(
                data, batch_sizes, mini_batch, True, True, 1, sorted_indices, unsorted_indices, data, given
            )
        if input.dim() not in (2, 3):
            raise ValueError(f"{self.mode}: Expected input to be 2D or 3D, got {input.dim()}D instead")
        batched = input.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        if not batched:
            input = input.unsqueeze(batch_dim)
        return Rows(input, None, input.size(batch_dim), False, batched, batch_dim, checked=input)

    @staticmethod
    def _state_batch(rows: Rows) -> int | Tensor:
        """The batch of the zero states made when none are given: under torch.jit.trace, a packed input's
        ``batch_sizes[0]`` as a tensor, as torch's forward reads it, so that the trace takes another
        batch (an int is a constant there)."""
        if rows.packed and torch.jit.is_tracing():
            return rows.batch_sizes[0]
        return rows.mini_batch

    def _checked_batch_sizes(self, data: Tensor, batch_sizes: Tensor) -> Tensor:
        """A hand-built PackedSequence's ``batch_sizes`` checked against its ``data`` (what
        pack_padded_sequence makes passes), with the exception types of torch's layers; steps of no
        sequences at its end, which torch's layers compute through, dropped."""
        if batch_sizes.dim() != 1 or batch_sizes.is_floating_point() or batch_sizes.is_complex():
            raise TypeError(
                f"{self.mode}: expected PackedSequence.batch_sizes as a 1-D int64 tensor, got a "
                f"{batch_sizes.dim()}-D {batch_sizes.dtype} one"
            )
        if batch_sizes.dtype != torch.long or batch_sizes.device.type != "cpu":
            raise RuntimeError(
                f"{self.mode}: expected PackedSequence.batch_sizes as an int64 CPU tensor (as "
                f"pack_padded_sequence makes it), got {batch_sizes.dtype} on {batch_sizes.device}"
            )
        sizes = batch_sizes.tolist()
        steps = len(sizes)
        while steps > 1 and sizes[steps - 1] == 0:
            steps -= 1
        if any(n < 0 for n in sizes) or any(a < b for a, b in zip(sizes, sizes[1:])):
            raise RuntimeError(
                f"{self.mode}: expected PackedSequence.batch_sizes non-increasing and not negative (the "
                f"sequences sorted by decreasing length), got {sizes}"
            )
        if sum(sizes) != data.shape[0]:
            raise RuntimeError(
                f"{self.mode}: expected PackedSequence.data of sum(batch_sizes) = {sum(sizes)} rows, got "
                f"{data.shape[0]}"
            )
        return batch_sizes[:steps] if steps < len(sizes) else batch_sizes

    def _to_rows(self, rows: Rows) -> None:
        """A padded batch is a packed one whose sequences all have length T: time-major rows."""
        if rows.packed:
            return
        x = rows.data.transpose(0, 1) if self.batch_first else rows.data
        steps = x.size(0)
        if steps == 0:
            raise RuntimeError("Expected sequence length to be larger than 0 in RNN")  # torch's words
        rows.data = x.reshape(steps * rows.mini_batch, self.input_size)
        # on the CPU, as a PackedSequence's: not on a default device (torch.set_default_device)
        rows.batch_sizes = torch.full((steps,), rows.mini_batch, dtype=torch.long, device="cpu")
        rows.step_sizes = [rows.mini_batch] * steps

    _CHECKS = ("check_forward_args", "get_expected_hidden_size", "check_hidden_size")

    def _checks_overridden(self) -> bool:
        """Whether a subclass overrides what torch's forward checks through (``check_forward_args`` and
        the methods it calls): torch's forward then runs the override, as tandem's does. Otherwise the
        checks are made with the batch of the rows, not read again from a PackedSequence's batch_sizes."""
        cls = type(self)
        own = next(c for c in cls.__mro__ if ours(c))
        return any(getattr(cls, name) is not getattr(own, name) for name in self._CHECKS)

    def _check_state_size(self, rows: Rows, state: Tensor, size: int, message: str) -> None:
        """torch's check_forward_args for one state, with the batch of ``rows`` (not read again from a
        PackedSequence's batch_sizes): the same checks, sizes and messages."""
        directions = 2 if self.bidirectional else 1
        expected = (self.num_layers * directions, rows.mini_batch, size)
        torch.nn.RNNBase.check_hidden_size(self, state, expected, message)  # (not a subclass's: see callers)

    @staticmethod
    def _refuse_inference_weights(weights: list[Tensor], inputs: list[Tensor]) -> None:
        """torch's error where its layer would save a weight that is an inference tensor for backward (a
        module made under ``torch.inference_mode``, run with autograd outside it): tandem's ops save copies
        of the weights, and their gradients were silently lost. Raised by a product that saves the weight, in
        the installed torch's words. (An inference input or state: the ops save it and raise themselves.)"""
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        if not any(t.requires_grad for t in (*weights, *inputs)):
            return
        for w in weights:
            if w.is_inference():
                torch.mul(w, torch.ones((), dtype=w.dtype, device=w.device, requires_grad=True))

    def _check_devices_and_dtypes(
        self, data: Tensor, states: dict[str, Tensor], weight: Tensor, exempt: tuple[str, ...] = ()
    ) -> None:
        """``weight``: the first layer's input weights (of :meth:`_current_weights`); the states named in
        ``exempt`` may have another dtype than the input."""
        if data.device != weight.device:
            raise RuntimeError(
                "Input and parameter tensors are not at the same device, found input tensor at "
                f"{data.device} and parameter tensor at {weight.device}"
            )
        for name, t in states.items():
            if t.device != data.device:
                raise RuntimeError(
                    "Input and hidden tensors are not at the same device, found input tensor at "
                    f"{data.device} and hidden tensor at {t.device}"
                )
            if t.dtype != data.dtype and name not in exempt:
                raise RuntimeError(
                    f"{self.mode}: expected {name} of dtype {data.dtype} (the input's dtype), got {t.dtype}"
                )

    def _check_weight_dtypes(self, weights: dict[str, Tensor], data: Tensor) -> None:
        """Every weight in the input's dtype (``weights``: :meth:`_current_weights`), as torch's layers
        need them, whose products refuse a mix (the first input weight: :meth:`check_input`); tandem's
        kernels computed in the input's dtype without a word."""
        for name, w in weights.items():
            if w.dtype != data.dtype and name != "weight_ih_l0":
                raise RuntimeError(
                    f"{self.mode}: expected {name} of dtype {data.dtype} (the input's and the other "
                    f"weights'), got {w.dtype}"
                )

    def _dropout(self, layer_output: Tensor, layer: int) -> Tensor:
        if self.training and layer < self.num_layers - 1 and not 0.0 <= self.dropout <= 1.0:
            # a dropout set after construction: torch's rnn op's check, its error and its number format
            raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {self.dropout:g}")
        if self.dropout > 0 and self.training and layer < self.num_layers - 1:
            return torch.nn.functional.dropout(layer_output, self.dropout, training=True)
        return layer_output

    def _give_output(self, rows: Rows, output: Tensor) -> Tensor | PackedSequence:
        """The last layer's rows ``[P, D*H]`` in the form of the input."""
        if rows.packed:
            return PackedSequence(output, rows.given_batch_sizes, rows.sorted_indices, rows.unsorted_indices)
        out = output.view(rows.batch_sizes.numel(), rows.mini_batch, output.shape[-1])
        if self.batch_first:
            out = out.transpose(0, 1)
        return out if rows.batched else out.squeeze(rows.batch_dim)
