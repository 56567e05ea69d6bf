"""Built-in device drivers. Each sub-package can be read alone; none imports another.

May import: ``hal``.
"""

import hal  # noqa: F401, E402 - first: it keeps torch from auto-loading vendor stacks
