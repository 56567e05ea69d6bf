"""scripts/install_torch.py: which torch build ``make setup`` installs (issue 45)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "install_torch.py"))
decide, command, on_disk = SCRIPT["decide"], SCRIPT["command"], SCRIPT["_on_disk"]


def _never():
    raise AssertionError("the index was probed where it need not be")


@pytest.mark.parametrize(
    "variant, machine, gpu, disk, reachable, source, says",
    [
        ("auto", "x86_64", False, False, lambda: True, "cpu-index", "CPU build from PyTorch"),
        ("auto", "x86_64", False, False, lambda: False, "registry", "did not answer within 5 s"),
        ("auto", "x86_64", False, True, _never, "registry", "already on this machine"),
        ("auto", "x86_64", True, False, _never, "registry", "a CUDA GPU is present"),
        ("auto", "aarch64", False, False, _never, "registry", "CPU build here"),
        ("cpu", "aarch64", True, True, _never, "cpu-index", "TORCH_VARIANT=cpu"),
        ("cuda", "x86_64", False, False, _never, "registry", "TORCH_VARIANT=cuda"),
    ],
)
def test_the_build_follows_the_machine(variant, machine, gpu, disk, reachable, source, says):
    got, why = decide(variant, machine, gpu, disk, reachable)
    assert got == source and says in why


def test_the_commands_and_a_wrong_variant():
    assert command("py", "torch==2.13.0", "cpu-index")[-3:] == [
        "--extra-index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0+cpu"
    ]  # fmt: skip
    assert command("py", "torch==2.13.0", "registry")[-1] == "torch==2.13.0"
    with pytest.raises(SystemExit, match="TORCH_VARIANT must be auto, cpu, cuda or registry"):
        decide("gpu", "x86_64", False, False, _never)


def test_a_pin_no_index_offers_is_not_on_disk():
    # (Where this machine keeps the pinned wheel in pip's find-links, the pin itself is.)
    assert not on_disk(sys.executable, "torch==1.0.0.post999")
