"""Transfer links (see `base` for the model every link follows): direct, emulated and CUDA, and `--link` specs."""

from .base import DirectLink, Flag, Link, PrioritySchedule, Ticket
from .cuda import CudaLink
from .emulated import EmulatedLink
from .spec import make_link, parse_link

__all__ = [
    "CudaLink",
    "DirectLink",
    "EmulatedLink",
    "Flag",
    "Link",
    "PrioritySchedule",
    "Ticket",
    "make_link",
    "parse_link",
]
