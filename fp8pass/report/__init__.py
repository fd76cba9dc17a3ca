"""What the fp8 backend did to a model, for people: the explain report, its merge across graphs, the drawing.

Below the backend, which fills a report per graph; ``fp8pass.explain`` (``fp8pass/model_report.py``)
runs the backend over a model and merges them.

* ``report.py``: :class:`Report` and its entries, and the accounting of every matmul weight;
* ``from_plan.py``: the entries a graph's plan gives, and the merge of per-graph reports;
* ``draw.py``: the one-box-per-layer-pattern drawing of ``fp8pass inspect --draw``.
"""

from .from_plan import decided_by, expert_entries, merge_reports, no_fp8_message
from .report import ExpertsEntry, Report, SwiGLUEntry

__all__ = ["Report", "SwiGLUEntry", "ExpertsEntry", "merge_reports", "expert_entries", "decided_by", "no_fp8_message"]
