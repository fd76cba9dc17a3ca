"""The pieces of a :class:`~fp8pass.report.report.Report` that come from a plan, and the merge of per-graph reports.

The backend (``compile_backend.py``) builds one Report per graph with these and merges them for
``Backend.report()`` and ``fp8pass.explain``.
"""

from __future__ import annotations

from .report import ExpertsEntry, Report, SwiGLUEntry

__all__ = ["merge_reports", "expert_entries", "decided_by", "no_fp8_message"]


def merge_reports(reports: list[Report], config=None) -> Report:
    out = Report(config=config, num_graphs=len(reports))
    for i, r in enumerate(reports):
        out.swiglus += [SwiGLUEntry(s.gate, s.up, s.down, s.variant, i) for s in r.swiglus]
        out.experts += [ExpertsEntry(e.module, e.weights, e.variant, i) for e in r.experts]
        out.linears += [f for f in r.linears if f not in out.linears]
        out.decided_by.update(r.decided_by)
        out.skipped += r.skipped
        out.graph_breaks += r.graph_breaks
    out.graph_before = "\n".join(f"# graph {i}\n{r.graph_before}" for i, r in enumerate(reports))
    out.graph_after = "\n".join(f"# graph {i}\n{r.graph_after}" for i, r in enumerate(reports))
    return out


def decided_by(plan, done: set[str]) -> dict[str, str]:
    """Weight FQN -> its site's recipe and the rule that chose it, for the weights made FP8/NVFP4."""
    out: dict[str, str] = {}
    for p in plan.walk():  # higher-order op bodies too
        for site in p.glus + p.expert_glus + p.loop_glus:
            for f in (site.gate, site.up, site.down):
                out[f] = site.recipe.describe(glu=True)
        for site in p.linears + p.expert_linears + p.loop_linears:
            out[site.fqn] = site.recipe.describe()
    return {f: d for f, d in out.items() if f in done}


def _owner(weight_fqn: str) -> str:
    """The module holding a weight ("<root>" for the compiled module's own parameters)."""
    return weight_fqn.rsplit(".", 1)[0] if "." in weight_fqn else "<root>"


def expert_entries(plan, graph: int) -> list[ExpertsEntry]:
    """One entry per expert stack (module) the plan makes FP8."""
    stacks: dict[str, tuple[list[str], str]] = {}
    for site in plan.expert_glus:
        weights = list(dict.fromkeys([site.gate, site.up, site.down]))
        stacks[_owner(site.down)] = (weights, site.variant + " experts")
    for lin in plan.expert_linears:
        weights, variant = stacks.setdefault(_owner(lin.fqn), ([], "grouped linears"))
        weights.append(lin.fqn)
    for site in plan.loop_glus:  # a per-expert loop: one stack, however many experts the loop calls
        weights, _ = stacks.setdefault(_owner(site.down), ([], site.variant + " experts (per-expert loop)"))
        weights += [w for w in dict.fromkeys((site.gate, site.up, site.down)) if w not in weights]
    for lin in plan.loop_linears:
        weights, _ = stacks.setdefault(_owner(lin.fqn), ([], "linears (per-expert loop)"))
        weights += [lin.fqn] if lin.fqn not in weights else []
    return [ExpertsEntry(mod, tuple(w), v, graph) for mod, (w, v) in stacks.items()]


def no_fp8_message(model_name: str, reports: list[Report]) -> str:
    """The warning for a model compiled with the fp8 backend whose graphs hold no FP8 op, with the
    plan's reasons (the linears it kept and why, or that there was no linear to convert)."""
    kept = [entry for r in reports for entry in r.skipped]
    head = (f"fp8pass: {model_name} was compiled with the fp8 backend, but none of its graphs holds an FP8 op, "
            f"so it runs in high precision. ")
    if kept:
        shown = "; ".join(f"{where}: {reason}" for where, reason in kept[:3])
        more = f" (+{len(kept) - 3} more)" if len(kept) > 3 else ""
        why = f"The plan kept all {len(kept)} linear op(s): {shown}{more}."
    else:
        why = ("Its graphs hold no linear op the backend converts (nn.Linear / F.linear / matmul with a weight, "
               "GPT-2's Conv1D, MoE expert weights).")
    return head + why + " fp8pass.explain(model, *inputs) prints the whole plan."
