"""The graph passes of the fp8 backend: annotate a Dynamo graph, plan it, rewrite a copy of it.

This is the API the backend (``compile_backend.py``) and the explain report (``fp8pass.report``) use;
the submodules are the passes' internals:

* naming: :class:`FrameNames`, :func:`frame_names`, :func:`frame_root`, :func:`names_for`,
  :func:`top_module` (absolute parameter FQNs of a compiled frame, ``names.py``);
* annotation: :func:`annotate_graph` (every node's facts, once; ``annotate.annotate``),
  :func:`relative_param_names` (``annotate.py``);
* matching: the declarative patterns the plan matches, :data:`LINEAR`, :data:`GLU_MLP`,
  :data:`GROUPED_LINEAR`, :data:`EXPERT_GLU` (``patterns.py``), built from :class:`Pattern` nodes and
  matched into a :class:`Match` (``matcher.py``); :data:`WEIGHT_VIEWS`, the view ops the plan
  follows from a weight to its matmul;
* planning: :func:`plan_graph` -> :class:`Plan` (``plan.py``), with the keep-high-precision policy
  and :func:`unmatched_rules` (``policy.py``);
* rewriting: :func:`copy_graph_module`, :func:`apply_plan` -> the rewritten graph and its
  :class:`StateInput` extra inputs (``rewrite.py``);
* compiled models: :func:`compile_backend_of`, :func:`original_callable`,
  :func:`inplace_compile_suspended` (``uncompiled.py``).
"""

from .annotate import annotate as annotate_graph  # the submodule keeps the name ``annotate``
from .annotate import relative_param_names
from .matcher import Match, Pattern
from .names import FrameNames, frame_names, frame_root, names_for, top_module
from .patterns import EXPERT_GLU, GLU_MLP, GROUPED_LINEAR, LINEAR
from .plan import _WEIGHT_VIEWS as WEIGHT_VIEWS
from .plan import Plan, plan_graph
from .policy import unmatched_rules
from .rewrite import StateInput, apply_plan, copy_graph_module
from .uncompiled import compile_backend_of, inplace_compile_suspended, original_callable

__all__ = [
    "FrameNames", "frame_names", "frame_root", "names_for", "top_module",
    "annotate_graph", "relative_param_names",
    "Match", "Pattern", "LINEAR", "GLU_MLP", "GROUPED_LINEAR", "EXPERT_GLU", "WEIGHT_VIEWS",
    "Plan", "plan_graph", "unmatched_rules",
    "StateInput", "apply_plan", "copy_graph_module",
    "compile_backend_of", "inplace_compile_suspended", "original_callable",
]
