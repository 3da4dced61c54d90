"""Checks that a path the user named for output can be written, made before any work is done:
a run must not train for an hour and then fail to save, nor leave half its outputs behind."""

import tempfile
from pathlib import Path

from oomless.errors import InputError


def check_output_path(path: Path | str, flag: str, directory: bool = False) -> Path:
    """Return ``path`` if it is (or can be created as) a directory (``directory=True``) or a file to
    write; else raise `InputError` naming ``flag``. Missing parent folders are fine: writers create them."""
    path = Path(path)
    if path.exists():
        if directory and not path.is_dir():
            raise InputError(f"{flag} {path} is a file; name a directory (created if missing)")
        if not directory and path.is_dir():
            raise InputError(f"{flag} {path} is a directory; name a file in it, e.g. {path / 'out'}")
    parent = path if directory and path.is_dir() else path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"{flag} {path} cannot be created: {parent} is a file, not a directory")
    # Tried, not asked: os.access lets root through where the filesystem still refuses (/proc, a
    # read-only mount), and a --save refused there lost the whole run's weights at its end.
    try:
        with tempfile.TemporaryFile(dir=parent, prefix=".oomless-probe-"):
            pass
    except OSError as error:
        raise InputError(f"{flag} {path} cannot be created: {parent} is not writable "
                         f"({error.strerror or error}); name a folder you can write to") from None
    return path
