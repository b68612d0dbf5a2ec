"""What each layer of the package pulls in: the scheduler, planner and simulator side
loads without torch (a capacity-planning machine need not install a model runtime)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module", ["dilaserve.sim", "dilaserve.scheduler", "dilaserve.planner", "dilaserve.bench"]
)
def test_module_loads_without_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
