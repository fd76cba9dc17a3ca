"""Delayed-scaling state of the runtime ops, and the ops that record amaxes into it.

The state of one delayed-scaled tensor is a :class:`fp8pass.numerics.DelayedScalingState`: plain
tensors ``[amax_history, scale, steps, skipped, overflows, guard, pending, accumulate]``
(``DelayedScalingState.OP_FIELDS``). The ops take it as a ``list[Tensor]`` (empty list: current
scaling) and never mutate it themselves (``register_autograd`` refuses ops that declare
``mutates_args``). Recording is separate and updates the state in place (the tensors keep their
identity and storage: graphs, CUDA graphs and checkpoints holding them see the update), with no
host read:

* forward: the op returns the amaxes of its FP8 operands; the compile backend records all of a
  graph's forward amaxes with one ``fp8pass::delayed_record_many_`` at the end of the graph (a fixed
  number of kernels per graph: the states are stacked, updated together and written back with
  ``_foreach_copy_``); eager callers use :meth:`LinearScalingState.record_forward`;
* backward: the op's backward formula calls ``fp8pass::delayed_record_`` on the ``grad_output``
  state. That op is composite (CompositeImplicitAutograd): AOT autograd traces its few aten ops into
  the backward graph, and Inductor fuses them into generated kernels instead of calling out.

Gradient accumulation: while a state's ``accumulate`` flag is set (:func:`accumulate_scaling`,
exported as ``fp8pass.accumulate_scaling``) a record only raises ``pending`` (the max of the
micro-batches' amaxes); :func:`commit_states` (per model: :func:`commit_scaling`) enters it into the
history once.

Per model (the state is keyed by weight; a compiled model's ``parameters()`` are its module's):
:func:`delayed_state_of` finds a weight's state, :func:`kept_scaling_state` runs a region (an
evaluation) without it changing any state of the model's weights (hot-channel patching and
stochastic-rounding streams included), :func:`restart_history` empties a weight's histories (a
precision switch). Checkpointing the state is :mod:`fp8pass.checkpoint`'s. Non-finite amaxes are skipped and counted on the device; nothing
here warns (reading the counters is a sync): ``fp8pass.monitor.check_scaling`` and the trainer do.

Under ``torch.no_grad`` / ``inference_mode`` no backward runs, so no grad_output amax is recorded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ..config import DelayedScaling
from ..kernels import uses_triton
from ..numerics import E4M3, E5M2, ROLES, DelayedScalingState, Format, get_format
from ..numerics.scaling import commit_update, record_update
from .hcp import _REGISTRY as _HCP_REGISTRY
from .sr import _REGISTRY as _SR_REGISTRY

__all__ = ["delayed_record_", "delayed_record_many_", "state_snapshot", "commit_states", "record", "LinearScalingState", "state_for",
           "grouped_state_for", "ROLES", "delayed_state_of", "kept_scaling_state", "commit_scaling", "accumulate_scaling",
           "restart_history"]



# The record is a composite op: Dynamo and AOT autograd see its few aten ops (a max, a roll, a
# reduction over H entries, a division), so Inductor fuses each record into the graph's generated
# kernels instead of calling out to Python; eager calls run the same code.
_LIB = torch.library.Library("fp8pass", "FRAGMENT")
_LIB.define(
    "delayed_record_(Tensor(a!) history, Tensor(b!) scale, Tensor(c!) steps, Tensor(d!) skipped, "
    "Tensor(e!) overflows, Tensor guard, Tensor(f!) pending, Tensor accumulate, Tensor amax, str fmt, "
    "float margin, int interval, str algo, bool power_of_two) -> ()")
_LIB.define(
    "delayed_record_many_(Tensor(a!)[] history, Tensor(b!)[] scale, Tensor(c!)[] steps, Tensor(d!)[] skipped, "
    "Tensor(e!)[] overflows, Tensor(f!)[] pending, Tensor[] accumulate, Tensor[] amax, str[] fmt, "
    "float margin, int interval, str algo, bool power_of_two) -> ()")


def _recipe(history: torch.Tensor, margin, interval, algo, power_of_two) -> DelayedScaling:
    return DelayedScaling(history_len=history.shape[-1], margin=margin, interval=interval, algo=algo,
                          power_of_two=power_of_two)


# Records are state updates, not differentiable: they run without autograd. Otherwise, called eagerly
# with an amax that requires grad (Config(compiler="eager") runs the rewritten graph as it is), the
# write-back gives the state tensors a grad_fn, and the next step's casts reading them fail in
# backward ("derivative for _foreach_copy_ is not implemented").
@torch.no_grad()
def delayed_record_(history, scale, steps, skipped, overflows, guard, pending, accumulate, amax, fmt: str,
                    margin: float, interval: int, algo: str, power_of_two: bool) -> None:
    """Record ``amax`` into one delayed-scaling state, in place (the recipe is passed as scalars).

    The state is the op list ``DelayedScalingState.OP_FIELDS``; :func:`fp8pass.numerics.scaling.record_update`
    is the math (with ``accumulate`` set only ``pending`` rises). Also records a stack of per-expert
    states in one call: ``history`` [E, H], ``scale``/``steps``/``skipped``/``overflows``/``pending``/
    ``amax`` [E]. ``guard`` is read by the casts, not here. Nothing is read back to the host: the
    skipped and overflow counters are reported when asked (``fp8pass.monitor.scaling_telemetry``,
    the trainer's log).
    """
    if amax.numel() != scale.numel() or history.shape[:-1] != scale.shape:
        raise ValueError(f"delayed_record_: history {tuple(history.shape)} must be [..., H] with scale "
                         f"{tuple(scale.shape)} = [...] and as many amaxes, got amax {tuple(amax.shape)}")
    states = [[history, scale, steps, skipped, overflows, guard, pending, accumulate]]
    if _one_launch(states, [amax]):
        from ..kernels import triton_scaling

        triton_scaling.record_states(states, amax.to(torch.float32), fmt, margin, interval, algo, power_of_two)
        return
    new = record_update(amax, history, scale, steps, skipped, overflows, pending, accumulate,
                        _recipe(history, margin, interval, algo, power_of_two), fmt)
    for t, v in zip((history, scale, steps, skipped, overflows, pending), new):
        t.copy_(v)


_LIB.impl("delayed_record_", delayed_record_, "CompositeImplicitAutograd")


@torch.no_grad()  # as delayed_record_: a state update, never part of autograd's graph
def delayed_record_many_(history: list, scale: list, steps: list, skipped: list, overflows: list, pending: list,
                         accumulate: list, amax: list, fmt: list, margin: float, interval: int, algo: str,
                         power_of_two: bool) -> None:
    """:func:`delayed_record_` for many states in one call (the states of one graph's forward).

    The states are concatenated along their rows per (format, history length), updated as one
    stack, and written back with ``_foreach_copy_``: a fixed number of kernels whatever the number of
    states. Each state must appear once (the backend merges repeated uses of a weight into one
    amax with ``maximum``); ``fmt[i]`` is the format of state ``i``.
    """
    n = len(history)
    if not all(len(v) == n for v in (scale, steps, skipped, overflows, pending, accumulate, amax, fmt)):
        raise ValueError("delayed_record_many_: every list needs one entry per state")
    recipe_args = (margin, interval, algo, power_of_two)
    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        groups.setdefault((fmt[i], history[i].shape[-1]), []).append(i)
    for (f, _), idx in groups.items():
        states = [[history[i], scale[i], steps[i], skipped[i], overflows[i], scale[i], pending[i], accumulate[i]]
                  for i in idx]  # (guard is not read by a record: its slot holds any tensor)
        if _one_launch(states, [amax[i] for i in idx]):
            from ..kernels import triton_scaling

            amaxes = [amax[i].reshape(()).to(torch.float32) for i in idx]
            triton_scaling.record_states(states, amaxes if len(idx) <= 4 else torch.stack(amaxes), f, *recipe_args)
            continue
        _update_rows([history[i] for i in idx], [scale[i] for i in idx], [steps[i] for i in idx],
                     [skipped[i] for i in idx], [overflows[i] for i in idx], [pending[i] for i in idx],
                     [accumulate[i] for i in idx], [amax[i] for i in idx], f, recipe_args)


def _one_launch(states: list[list[torch.Tensor]], amaxes: list[torch.Tensor]) -> bool:
    """Whether these records take the one-launch Triton kernel: the Triton (GPU) kernels, single states
    (no expert stacks), and real tensors. Under tracing (fake or functional tensors: a compiled
    graph's backward) the torch math is traced instead, and Inductor fuses it into the graph's kernels.
    """
    return (uses_triton(states[0][0].device) and all(s[1].dim() == 0 and a.numel() == 1 for s, a in zip(states, amaxes))
            and all(type(t) is torch.Tensor for s in states for t in s) and all(type(a) is torch.Tensor for a in amaxes))


def _rows(ts: list[torch.Tensor], width: int | None = None, plain: bool = True) -> torch.Tensor:
    """Per-state tensors as one stack of rows: ``stack`` when every state is a single one (one op,
    no per-state views), else concatenated (an expert stack contributes E rows)."""
    if plain:
        return torch.stack(ts)
    return torch.cat([t.reshape(-1) if width is None else t.reshape(-1, width) for t in ts])


def _write_rows(dst: list[torch.Tensor], rows: torch.Tensor, plain: bool = True) -> None:
    if plain:
        torch._foreach_copy_(dst, list(rows.unbind(0)))
        return
    sizes = [t.numel() if rows.dim() == 1 else t.numel() // rows.shape[-1] for t in dst]
    torch._foreach_copy_(dst, [r.view(t.shape) for r, t in zip(rows.split(sizes), dst)])


def _update_rows(history, scale, steps, skipped, overflows, pending, accumulate, amax, fmt, recipe_args,
                 commit: bool = False) -> None:
    """Record (or, with ``commit``, enter the pending amaxes of) states of one format, as one stack."""
    width = history[0].shape[-1]
    plain = all(s.dim() == 0 for s in scale) and (commit or all(a.numel() == 1 for a in amax))
    h, sc, st, sk, ov, pe = (_rows(history, width, plain), _rows(scale, None, plain), _rows(steps, None, plain),
                             _rows(skipped, None, plain), _rows(overflows, None, plain), _rows(pending, None, plain))
    recipe = _recipe(history[0], *recipe_args)
    if commit:
        new = commit_update(h, sc, st, sk, ov, pe, recipe, fmt)
    elif plain:
        amaxes = torch.stack([a.reshape(()) if a.dim() else a for a in amax])
        new = record_update(amaxes, h, sc, st, sk, ov, pe, torch.stack(accumulate), recipe, fmt)
    else:
        acc = torch.cat([a.reshape(1).expand(s.numel()) for a, s in zip(accumulate, scale)])
        new = record_update(_rows(amax, None, False), h, sc, st, sk, ov, pe, acc, recipe, fmt)
    for dst, rows in zip((history, scale, steps, skipped, overflows, pending), new):
        _write_rows(dst, rows, plain)


_LIB.impl("delayed_record_many_", delayed_record_many_, "CompositeExplicitAutograd")


@torch.library.register_fake("fp8pass::delayed_record_many_", lib=_LIB)
def _(history, scale, steps, skipped, overflows, pending, accumulate, amax, fmt, margin, interval, algo,
      power_of_two):
    return None


# A copy of states a recomputed region reads (activation checkpointing, passes/rewrite_hop.py): an
# opaque op, because Inductor removes an aten.clone of a graph input before partitioning, and the
# backward's recomputation would then read the input after the forward's records updated it.
_LIB.define("state_snapshot(Tensor[] state) -> Tensor[]")


def state_snapshot(state: list) -> list:
    """Copies of the state tensors (for a region that activation checkpointing recomputes)."""
    return [t.clone() for t in state]


_LIB.impl("state_snapshot", state_snapshot, "CompositeExplicitAutograd")


@torch.library.register_fake("fp8pass::state_snapshot", lib=_LIB)
def _(state):
    return [torch.empty_like(t) for t in state]


def commit_states(states: list[DelayedScalingState]) -> None:
    """Enter every state's accumulated amax into its history, batched per (recipe, format) (eager)."""
    groups: dict[tuple, list[DelayedScalingState]] = {}
    for s in {id(s): s for s in states}.values():
        r = s.recipe
        groups.setdefault((s.fmt.name, r.history_len, r.margin, r.interval, r.algo, r.power_of_two,
                           s.scale.device), []).append(s)
    for (fmt, _, margin, interval, algo, p2, _), ss in groups.items():
        _update_rows(*([getattr(s, f) for s in ss] for f in ("amax_history", "scale", "steps", "skipped",
                                                               "overflows", "pending", "accumulate")),
                     None, fmt, (float(margin), int(interval), algo, bool(p2)), commit=True)


def record(state: list[torch.Tensor], amax: torch.Tensor, fmt: Format | str, recipe: DelayedScaling) -> None:
    """Record ``amax`` into ``state`` (the op list ``DelayedScalingState.op_tensors()``) through the op."""
    torch.ops.fp8pass.delayed_record_(*state, amax.detach(), get_format(fmt).name, float(recipe.margin),
                                      int(recipe.interval), recipe.algo, bool(recipe.power_of_two))


def _tensors(s: DelayedScalingState) -> list[torch.Tensor]:
    return s.op_tensors()


@dataclass
class LinearScalingState:
    """Delayed-scaling state of one FP8 linear: its input, weight and grad_output.

    Args:
        recipe: the DelayedScaling recipe (shared by the three roles).
        device: where the state tensors live.
        fwd_format, bwd_format: formats of input/weight and of grad_output.
        experts: None for a linear; E for the grouped (MoE) ops, whose every role is a stack of E
            per-expert states (history [E, H], scale/steps/skipped [E]; each expert's step count
            advances on every call, also when the expert got no rows).

    Attributes:
        input, weight, grad_output: :class:`DelayedScalingState` each.

    ``op_args()`` gives the three ``list[Tensor]`` arguments of ``fp8pass::fp8_linear``;
    ``record_forward`` records the amaxes that op returned. The backward records grad_output itself.
    """

    recipe: DelayedScaling
    device: torch.device | str = "cpu"
    fwd_format: Format | str = E4M3
    bwd_format: Format | str = E5M2
    experts: int | None = None

    def __post_init__(self):
        fwd, bwd = get_format(self.fwd_format), get_format(self.bwd_format)
        self.input = DelayedScalingState(self.recipe, fwd, self.device, self.experts)
        self.weight = DelayedScalingState(self.recipe, fwd, self.device, self.experts)
        self.grad_output = DelayedScalingState(self.recipe, bwd, self.device, self.experts)

    def roles(self) -> dict[str, DelayedScalingState]:
        return {"input": self.input, "weight": self.weight, "grad_output": self.grad_output}

    def op_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """``(x_state, w_state, g_state)`` for the op: the live tensors (mutated by recording)."""
        return _tensors(self.input), _tensors(self.weight), _tensors(self.grad_output)

    def recipe_args(self) -> dict:
        """The recipe as the ops' plain scalar arguments."""
        r = self.recipe
        return {"margin": float(r.margin), "interval": int(r.interval), "algo": r.algo,
                "power_of_two": bool(r.power_of_two)}

    def record_forward(self, x_amax: torch.Tensor, w_amax: torch.Tensor) -> None:
        """Record the forward's amaxes of x and W (one ``delayed_record_many_``: one launch on a GPU)."""
        states = (_tensors(self.input), _tensors(self.weight))
        fields = [[st[i] for st in states] for i in (0, 1, 2, 3, 4, 6, 7)]
        r = self.recipe
        torch.ops.fp8pass.delayed_record_many_(*fields, [x_amax.detach(), w_amax.detach()],
                                               [self.input.fmt.name, self.weight.fmt.name], float(r.margin),
                                               int(r.interval), r.algo, bool(r.power_of_two))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat ``{role.field: tensor}`` (plain tensors, cloned)."""
        return {f"{role}.{k}": v for role, s in self.roles().items() for k, v in s.state_dict().items()}

    def to_device(self, device: torch.device | str) -> None:
        """Move every role's state to ``device``, keeping the tensor objects (see DelayedScalingState)."""
        for s in self.roles().values():
            s.to_device(device)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for role, s in self.roles().items():
            s.load_state_dict({k.split(".", 1)[1]: v for k, v in sd.items() if k.startswith(role + ".")})


_REGISTRY = WeakTensorKeyDictionary()  # weight -> LinearScalingState; keyed by identity, not value
# the open ``accumulate_scaling`` contexts: each a list of the states it accumulates; a state created
# while one is open (a weight's first compiled step) joins them
_ACCUMULATING: list[list[DelayedScalingState]] = []


def _created(st: "LinearScalingState") -> "LinearScalingState":
    for states in _ACCUMULATING:
        for s in st.roles().values():
            s.accumulate.fill_(True)
            states.append(s)
    return st


def state_for(weight: torch.Tensor, recipe: DelayedScaling, fwd_format=E4M3, bwd_format=E5M2) -> LinearScalingState:
    """The LinearScalingState kept for ``weight`` (created on first use; freed with the weight).

    A state created under a different recipe or formats is an error rather than silently reused.
    """
    st = _REGISTRY.get(weight)
    if st is None:
        st = _created(LinearScalingState(recipe, weight.device, fwd_format, bwd_format))
        _REGISTRY[weight] = st
        return st
    _check_same(st, recipe, fwd_format, bwd_format, weight)
    return st


def _check_same(st: LinearScalingState, recipe, fwd_format, bwd_format, weight: torch.Tensor) -> None:
    """A state made under another recipe is an error; one left on another device moves to the weight's.

    ``model.to(device)`` moves parameters in place (same objects), so the state keyed by a weight
    follows it here, when the backend compiles the moved model, instead of handing CPU scales to
    CUDA kernels.
    """
    experts = int(weight.shape[0]) if st.experts is not None else None
    if (st.recipe != recipe or st.input.fmt != get_format(fwd_format)
            or st.grad_output.fmt != get_format(bwd_format) or st.experts != experts):
        what = "this weight" if st.experts is None else f"this expert weight ({st.experts} experts)"
        raise ValueError(
            f"{what} already has delayed-scaling state for {st.recipe} "
            f"({st.input.fmt.name}/{st.grad_output.fmt.name}); pass state= explicitly to use another recipe"
        )
    if st.input.scale.device != weight.device:
        st.to_device(weight.device)


_GROUPED_REGISTRY = WeakTensorKeyDictionary()  # expert weight [E, ...] -> LinearScalingState(experts=E)


def grouped_state_for(weight: torch.Tensor, recipe: DelayedScaling, fwd_format=E4M3, bwd_format=E5M2
                      ) -> LinearScalingState:
    """Per-expert delayed-scaling state kept for a stacked expert weight ``[E, ...]`` (like :func:`state_for`).

    The state has ``experts = weight.shape[0]``; its ``op_args()`` are the ``x_state``/``w_state``/
    ``g_state`` (or ``a_state``/``b_state``/``g_state``) lists of the grouped ops.
    """
    if weight.dim() != 3:
        raise ValueError(f"grouped_state_for needs a stacked expert weight [E, rows, cols], got {tuple(weight.shape)}")
    st = _GROUPED_REGISTRY.get(weight)
    if st is None:
        st = _created(LinearScalingState(recipe, weight.device, fwd_format, bwd_format, experts=int(weight.shape[0])))
        _GROUPED_REGISTRY[weight] = st
        return st
    _check_same(st, recipe, fwd_format, bwd_format, weight)
    return st


# ---- per model: the state of its weights --------------------------------------------------------

def delayed_state_of(weight: torch.Tensor) -> LinearScalingState | None:
    """The LinearScalingState of ``weight`` (per-expert for a stacked expert weight), or None."""
    st = _REGISTRY.get(weight)
    return st if st is not None else _GROUPED_REGISTRY.get(weight)


# ---- a region that leaves the state as it found it ---------------------------------------------


def _live_state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every live state tensor of ``model``'s weights: delayed scaling (all ``OP_FIELDS``, the counters and
    flags included), hot-channel patching and stochastic-rounding streams."""
    tensors = {}
    for p in model.parameters():
        st = delayed_state_of(p)
        for s in st.roles().values() if st is not None else ():
            tensors.update((id(t), t) for t in s.op_tensors())
        hcp = _HCP_REGISTRY.get(p)
        if hcp is not None:
            tensors.update((id(t), t) for t in hcp.op_args())
        sr = _SR_REGISTRY.get(p)
        if sr is not None:
            tensors[id(sr.stream)] = sr.stream
    return list(tensors.values())


@contextlib.contextmanager
def kept_scaling_state(model: torch.nn.Module):
    """Run a region (an evaluation in training mode) without it changing ``model``'s scaling state.

    A forward pass in training mode records its amaxes into the delayed-scaling histories (and updates
    hot-channel patching), so without this an evaluation between two optimizer steps would change the
    next step's scales: a run that evaluates at step N would train differently from one that does not.
    On exit every live state tensor gets back its value from the entry (in place: compiled graphs keep
    reading the same tensors). States first created inside the region are left as they are.

    Args:
        model: the model (compiled or not) whose weights own the states.
    """
    live = _live_state_tensors(model)
    saved = [t.clone() for t in live]
    try:
        yield
    finally:
        if live:  # (a model without FP8 state: _foreach_copy_ refuses empty lists)
            with torch.no_grad():
                torch._foreach_copy_(live, saved)


# ---- gradient accumulation: one history entry per optimizer step -------------------------------

def _model_states(model: torch.nn.Module) -> list:
    states = {}
    for p in model.parameters():
        st = delayed_state_of(p)
        if st is not None:
            for s in st.roles().values():
                states[id(s)] = s
    return list(states.values())


def commit_scaling(model: torch.nn.Module) -> None:
    """Enter the amaxes accumulated in ``model``'s delayed-scaling states into their histories.

    A no-op for states with nothing pending. :func:`accumulate_scaling` calls it on exit; call it
    yourself only if you set the states' ``accumulate`` flags by hand. One batched update per
    (format, recipe), no host read.
    """
    commit_states(_model_states(model))


@contextlib.contextmanager
def accumulate_scaling(model: torch.nn.Module, enabled: bool = True):
    """Gradient accumulation for delayed scaling: the micro-batches run inside record one amax.

    Inside the context every record into ``model``'s delayed-scaling states (forward and backward,
    compiled or eager) only raises the state's pending amax; the scales the casts use stay as they
    were. On exit the max over all micro-batches enters each history once (:func:`commit_scaling`),
    so the scales change once per optimizer step, as if the micro-batches were one batch. States
    created inside the context (a weight's first compiled step) accumulate too. A NaN/Inf in any
    micro-batch makes that step's amax non-finite: it is skipped and counted, as a single record is.

    Usage::

        for step in range(steps):
            with fp8pass.accumulate_scaling(model):
                for x, y in micro_batches:
                    loss_fn(model(x), y).backward()
            optimizer.step()

    Args:
        model: the model (compiled or not) whose weights own the states.
        enabled: False makes the context a no-op (``enabled=grad_accum > 1``).
    """
    if not enabled:
        yield
        return
    states = _model_states(model)
    for s in states:
        s.accumulate.fill_(True)
    _ACCUMULATING.append(states)
    try:
        yield
    finally:
        _ACCUMULATING.remove(states)
        open_elsewhere = {id(s) for other in _ACCUMULATING for s in other}
        mine = [s for s in states if id(s) not in open_elsewhere]
        for s in mine:
            s.accumulate.fill_(False)
        commit_states(mine)


def restart_history(weight: torch.Tensor, roles=("input",)) -> bool:
    """Empty the delayed-scaling history of ``weight``'s ``roles``: their next cast scales from its own amax.

    For a precision switch that changes what a role's tensor is while the weight stays FP8 (a GLU's down
    projection switched to Smooth-SwiGLU: its input becomes ``h * c`` instead of ``h``, 1e5x smaller
    under an outlier), the old amaxes would set the first ``history_len`` scales. Returns False when the
    weight has no delayed-scaling state.
    """
    st = delayed_state_of(weight)
    if st is None:
        return False
    for role in roles:
        s = getattr(st, role)
        s.amax_history.zero_()
        s.scale.fill_(1.0)
        s.steps.zero_()
        s.skipped.zero_()
    return True
