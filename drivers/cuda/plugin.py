"""Entry point ``rlt_hal: cuda``."""

from hal import DriverSpec, ProbeResult, hookimpl


def _probe() -> ProbeResult:
    import torch

    if torch.version.cuda is None:
        return ProbeResult(
            False,
            f"this torch build ({torch.__version__}) has no CUDA support; "
            "install a CUDA build of torch from https://pytorch.org",
        )
    if not torch.cuda.is_available():
        return ProbeResult(
            False,
            "torch has CUDA support but no CUDA device is visible "
            "(check the driver with nvidia-smi and CUDA_VISIBLE_DEVICES)",
        )
    return ProbeResult(True)


def _create(**options):
    from drivers.cuda.driver import create

    return create(**options)


@hookimpl
def rlt_hal_register_drivers() -> list[DriverSpec]:
    return [DriverSpec("cuda", _probe, _create, "NVIDIA GPU: cuda_eager (HF order), cuda_sdpa")]
