"""Child of tests/test_stage.py: stage a dataset and SIGKILL itself once ``KILL_AFTER`` bytes are copied.

    python tests/stage_kill_child.py SOURCE STAGE KILL_AFTER_BYTES

The kill comes from inside the copy (the progress callback), so it lands mid-file every time: what a
killed job, a pre-empted node or a lost mount leaves behind.
"""

import os
import signal
import sys

import oomless.data.stage as stage
from oomless.data.layout import find_dataset

source, stage_dir, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
stage._CHUNK_BYTES = 64 * 1024          # small chunks, so a few-hundred-KiB file is cut part way
copied = 0


def on_bytes(count: int) -> None:
    global copied
    copied += count
    if copied >= kill_after:
        os.kill(os.getpid(), signal.SIGKILL)


stage.stage_dataset(find_dataset(source), stage_dir, on_bytes=on_bytes)
print("finished without being killed")
