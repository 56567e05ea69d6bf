"""Built-in device drivers. Each sub-package can be read alone; none imports another."""
