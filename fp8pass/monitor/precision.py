"""The runtime precision audit: which precision and kernel each GEMM and collective of a model runs.

``precision_audit(model)`` returns one :class:`~fp8pass.precision_audit.GemmRecord` per GEMM (forward,
dgrad, wgrad) of every matmul weight the ``fp8`` backend compiled: the FP8 ops' (with their kernel
and any fallback) and the matmuls the plan kept in high precision (with the plan's reason). The
records are made when each graph is compiled (fp8pass/precision_audit.py), so reading them costs no
device work. ``collective_audit(model)`` lists FSDP2's all-gathers (FP8 or high precision).
"""

from __future__ import annotations

import torch

from ..passes.uncompiled import original_callable
from ..precision_audit import CollectiveRecord, GemmRecord, records_of, version

__all__ = ["precision_audit", "collective_audit", "audit_version", "audit_summary"]


def _module(model) -> torch.nn.Module | None:
    """The user's module behind ``model`` (a ``torch.compile`` wrapper, DDP, or the module itself)."""
    target = original_callable(model)
    target = getattr(target, "module", target) if isinstance(target, torch.nn.parallel.DistributedDataParallel) \
        else target
    return target if isinstance(target, torch.nn.Module) else None


def precision_audit(model) -> list[GemmRecord]:
    """One record per GEMM of ``model``'s matmul weights, as compiled by the ``fp8`` backend.

    Args:
        model: the model (as built, ``torch.compile``-wrapped or compiled in place; DDP/FSDP2-wrapped),
            or None for functions compiled with the backend.

    Returns:
        the records (weight FQN, GEMM, precision, operands, kernel, fallback reason, the plan's
        decision, op) of every FP8 op and of every matmul weight the plan kept in high precision, three
        per weight (forward, dgrad, wgrad); [] before the model's first compiled call.
    """
    module = None if model is None else _module(model)
    if model is not None and module is None:
        raise TypeError(f"fp8pass.monitor.precision_audit takes the model (an nn.Module, compiled or not) or None "
                        f"(compiled functions), got {type(model).__name__}")
    records = records_of(module)
    if module is None:
        return records
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    # kept entries name a weight, or a call without one (attention's products): keep the weights'
    return [r for r in records if r.op or r.weight in params]


def audit_version(model) -> int:
    """A counter that changes whenever ``model``'s records do (a recompile, a precision switch); cheap."""
    module = None if model is None else _module(model)
    return version(module)


def collective_audit(model) -> list[CollectiveRecord]:
    """One record per parameter FSDP2 all-gathers in ``model`` (FP8 codes or high precision); [] without FSDP2."""
    module = _module(model)
    if module is None:
        raise TypeError(f"fp8pass.monitor.collective_audit takes the model, got {type(model).__name__}")
    if not any(hasattr(m, "_get_fsdp_state") for m in module.modules()):
        return []
    # FSDP models only: fp8pass.distributed (and torch.distributed with it) loads when a model is sharded
    from ..distributed.fp8_all_gather import gather_records

    return gather_records(module, _fp8_gatherable(records_of(module)))


def _fp8_gatherable(records: list[GemmRecord]) -> set[str]:
    """The weights an FP8 all-gather could take (``fp8_all_gather_weights``' rule): a per-tensor FP8 forward
    GEMM, but not a channel-smoothed down projection (its columns are rescaled before the cast)."""
    return {r.weight for r in records if r.gemm == "forward" and r.precision == "fp8" and "per-" not in r.kernel
            and not (r.op == "swiglu_down" and "Smooth-SwiGLU channel" in r.decided_by)}


def audit_summary(records: list[GemmRecord]) -> dict[str, int]:
    """``{"forward fp8 torch._scaled_mm": 12, ...}``: how many GEMMs of each kind (GEMM, precision, kernel)."""
    out: dict[str, int] = {}
    for r in records:
        key = f"{r.gemm} {r.precision} {r.kernel}" + (" (fallback)" if r.fallback else "")
        out[key] = out.get(key, 0) + 1
    return out
