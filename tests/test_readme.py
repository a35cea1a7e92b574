"""The README's Python code blocks run as written: all of them, in order, in one fresh process on
4 host CPU devices (the ring attention block shards over 4), so that the README cannot rot."""

import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_the_blocks_this_test_promises_to_run():
    blocks = python_blocks()
    assert len(blocks) >= 3
    assert any("ring_attention" in b for b in blocks) and any("jax_flash.flax.nnx" in b for b in blocks)


def test_readme_python_blocks_run_as_written(tmp_path):
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n\n".join(python_blocks()))
    # On the CPU, compiled without LLVM's optimisations as conftest.py compiles the suite's.
    flags = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(script)], cwd=README.parent, env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
