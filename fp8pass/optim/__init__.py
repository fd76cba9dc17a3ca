"""FP8 Adam/AdamW: first moment in E4M3, second in E5M2, one byte each with per-block fp32 scales.

``fp8pass.optim.AdamW(params, lr=1e-3, m_format="e4m3", v_format="e5m2", block_size=128)`` is a
drop-in ``torch.optim.AdamW``; ``fp8pass.optim.to_fp8(optimizer)`` converts an existing torch
Adam/AdamW in place. See docs/optim.md.
"""

from .adam import Adam, AdamW, state_nbytes
from .convert import to_fp8
from .moments import MOMENT_FORMATS, MomentSpec, read_moment, write_moment
from .options import KERNELS, moment_specs
from .torch_state_dict import from_torch_state_dict, is_torch_state_dict, to_torch_state_dict

__all__ = [
    "Adam", "AdamW", "to_fp8", "to_torch_state_dict", "from_torch_state_dict", "is_torch_state_dict",
    "state_nbytes", "moment_specs", "MomentSpec", "MOMENT_FORMATS", "KERNELS", "read_moment", "write_moment",
]
