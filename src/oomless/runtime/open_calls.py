"""Module calls whose forward hook never ran.

torch runs a module's ``always_call`` forward hooks when its forward raises an ``Exception``, not a
``KeyboardInterrupt`` (Ctrl-C in a notebook, then the loop goes on) or ``SystemExit``: what a
forward pre-hook opened would stay open into every later step (the plan's saved-tensor hooks, a
recompute's checkpoint, whose pack hook took the next forwards' saves: wrong gradients or
CheckpointError; autocast around the loss). Each call is known by the frame of torch's
``Module.__call__`` running it (held only while the call is open); a call whose frame is not on the
stack when the next one starts was interrupted, where one whose frame is there is still running (the
model called inside its own forward).
"""

import sys
from types import FrameType

import torch

_MODULE_FILE = torch.nn.modules.module.__file__


def module_call_frame() -> FrameType | None:
    """The frame of torch's module call running the hook that calls this; None while torch.compile
    traces the hook (it cannot trace frames), where `is_running` answers as for a running call."""
    if torch.compiler.is_compiling():
        return None
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename != _MODULE_FILE:
        frame = frame.f_back
    return frame


def is_running(frame: FrameType | None) -> bool:
    """Whether ``frame`` is on this thread's stack (its call has not returned or raised past it);
    True for None (not known: taken as running, as before calls were told apart)."""
    if frame is None:
        return True
    current = sys._getframe(1)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False
