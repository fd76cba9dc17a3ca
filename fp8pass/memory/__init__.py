"""Where training memory lives: offloading saved activations (and, through ``fp8pass.optim``, optimizer
state) to host memory, with copies that overlap the device's compute (``transfer.py``)."""

from .saved_activations import OffloadStats, SavedActivationOffload, offload_saved_activations
from .transfer import HostTransfer

__all__ = ["offload_saved_activations", "SavedActivationOffload", "OffloadStats", "HostTransfer"]
