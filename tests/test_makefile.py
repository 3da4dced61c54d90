"""`make demo TORCH=...` installs that PyTorch requirement even once the virtual environment exists,
and again beside the extras (so that none of their dependencies replaces it), and installs nothing
again when TORCH is unchanged. Run against a stand-in Python whose venv tools
only log their calls, so the test takes a second and needs no network."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TORCH = re.search(r"^TORCH \?= (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)

FAKE_PYTHON = """#!/bin/sh
# Stands in for `python3 -m venv DIR`: DIR/bin/{pip,python,oomless} append their arguments to a log.
mkdir -p "$3/bin"
for tool in pip python oomless; do
  printf '#!/bin/sh\\necho "%s $*" >> "%s"\\n' "$tool" "$CALLS_LOG" > "$3/bin/$tool"
  chmod +x "$3/bin/$tool"
done
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_changed_torch_requirement_is_installed_into_an_existing_venv(tmp_path):
    python = tmp_path / "python3"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    log = tmp_path / "calls.log"
    environment = {**os.environ, "CALLS_LOG": str(log)}

    def make(*settings: str) -> list[str]:
        log.unlink(missing_ok=True)
        subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "demo", f"PYTHON={python}",
                        f"VENV={tmp_path / 'venv'}", *settings], check=True, capture_output=True, env=environment,
                       timeout=60)
        return [line for line in log.read_text().splitlines() if line.startswith("pip ")]

    assert make() == [f"pip install -q {DEFAULT_TORCH}", f"pip install -q -e .[test] {DEFAULT_TORCH}"]
    assert make() == []                                             # nothing changed, nothing installed
    assert make("TORCH=torch>=2.4") == ["pip install -q torch>=2.4", "pip install -q -e .[test] torch>=2.4"]
    assert make("TORCH=torch>=2.4") == []
    assert make() == [f"pip install -q {DEFAULT_TORCH}", f"pip install -q -e .[test] {DEFAULT_TORCH}"]   # back
