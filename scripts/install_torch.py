"""Install the torch the Makefile pins, the build this machine should have (``make setup``).

``python scripts/install_torch.py PIN [VARIANT]`` with the venv's python; PIN is
``torch==X.Y.Z``, VARIANT (``TORCH_VARIANT`` in the Makefile) one of:

- ``auto`` (the default): the CPU build from PyTorch's CPU wheel index on an x86-64 box without
  a CUDA GPU (the package registry's torch is the multi-GB CUDA build there), unless a wheel
  for the pin is already on this machine (in pip's find-links: then that one),
  or that index cannot be reached within a few seconds (then the registry's, said so);
  the registry's on a box with a CUDA GPU (its CUDA build) and on other architectures
  (aarch64's registry wheel is the CPU build);
- ``cpu``: PyTorch's CPU index, whatever the machine;
- ``cuda`` or ``registry``: the package registry's torch (on x86-64 Linux, the CUDA build).

The large download shows pip's progress bar. Standard library only: it runs before anything
else is installed.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_SECONDS = 5


def decide(variant: str, machine: str, cuda_gpu: bool, on_disk: bool, reachable) -> tuple[str, str]:
    """``(source, why)``: source ``"cpu-index"`` or ``"registry"``. ``reachable``: a callable
    asked only when the CPU index is wanted and nothing is on disk."""
    if variant in ("cuda", "registry"):
        return "registry", f"TORCH_VARIANT={variant}: the package registry's torch"
    if variant == "cpu":
        return "cpu-index", "TORCH_VARIANT=cpu: PyTorch's CPU wheel index"
    if variant != "auto":
        raise SystemExit(f"TORCH_VARIANT must be auto, cpu, cuda or registry, got {variant!r}")
    if on_disk:
        return "registry", "a wheel for the pin is already on this machine: that one"
    if cuda_gpu:
        return "registry", "a CUDA GPU is present: the registry's torch (its CUDA build)"
    if machine not in ("x86_64", "AMD64"):
        return "registry", f"{machine}: the registry's torch is the CPU build here"
    if not reachable():
        return "registry", (
            f"{CPU_INDEX} did not answer within {PROBE_SECONDS} s: the registry's torch (on "
            "x86-64 Linux the CUDA build, several GB; TORCH_VARIANT=cpu to insist on the index)"
        )
    return "cpu-index", "x86-64 without a CUDA GPU: the CPU build from PyTorch's CPU index"


def command(python: str, pin: str, source: str) -> list[str]:
    if source == "cpu-index":
        version = pin.split("==", 1)[1]
        local = pin if "+" in version else f"{pin}+cpu"
        return [python, "-m", "pip", "install", "--extra-index-url", CPU_INDEX, local]
    return [python, "-m", "pip", "install", pin]


def _cuda_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    done = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
    return done.returncode == 0 and "GPU" in done.stdout


def _on_disk(python: str, pin: str) -> bool:
    """Whether pip resolves the pin without any index, from its find-links alone (never the
    network: ``--no-index``)."""
    done = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet",
         "--report", "-", "--no-index", pin],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return False
    try:
        return bool(json.loads(done.stdout).get("install"))
    except json.JSONDecodeError:
        return False


def _reachable() -> bool:
    try:
        with urllib.request.urlopen(f"{CPU_INDEX}/torch/", timeout=PROBE_SECONDS) as reply:
            return reply.status == 200
    except OSError:
        return False


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2 or "==" not in argv[0]:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    pin, variant = argv[0], argv[1] if len(argv) > 1 else "auto"
    python = sys.executable
    source, why = decide(
        variant, platform.machine(), _cuda_gpu(), _on_disk(python, pin), _reachable
    )
    cmd = command(python, pin, source)
    print(f"torch: {why}\n  {' '.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
