"""Importing shmtier never needs vLLM; importing shmtier.vllm without it is one clear error.

Runs with or without vLLM installed (vLLM is hidden from a child interpreter).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import sys
    sys.modules["vllm"] = None  # as if vLLM were not installed: `import vllm` fails
    import shmtier, shmtier.config, shmtier.contract, shmtier.metrics, shmtier.spec
    import shmtier.scheduler.tiering.manager, shmtier.scheduler.tiering.factory
    import shmtier.gpu.copy_worker, shmtier.cli
    loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
    assert loaded == ["vllm"], loaded  # only our blocker: nothing imported vLLM
    try:
        import shmtier.vllm
    except ImportError as e:
        print("IMPORT-ERROR", type(e).__name__, e)
    else:
        print("IMPORTED")
""")


def test_shmtier_imports_without_vllm_and_the_adapter_says_what_it_needs():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("IMPORT-ERROR VLLMCompatibilityError"), out.stdout + out.stderr
    assert "vLLM >=0.32,<0.35" in line
    assert "cannot be imported" in line and "pip install" in line
