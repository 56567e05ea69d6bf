"""Every pluggy hook of rlt-hal lives here, grouped by lifecycle stage.

The project name and the entry-point group are both ``rlt_hal``: a driver package declares

    [project.entry-points.rlt_hal]
    mydriver = "mydriver.plugin"

and ``mydriver.plugin`` defines ``@hookimpl def rlt_hal_register_drivers()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from hal.spec import DriverSpec

PROJECT_NAME = "rlt_hal"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -- discovery -------------------------------------------------------------------------------


@hookspec
def rlt_hal_register_drivers() -> list[DriverSpec]:
    """Return the drivers this plugin provides.

    Called once per registry; results of all plugins are concatenated. Must be cheap and must
    not import a vendor stack (torch_npu, CANN, ...): that belongs in ``Driver.initialize``.

    :return: a list of :class:`hal.types.DriverSpec`, possibly empty.
    """
    raise NotImplementedError
