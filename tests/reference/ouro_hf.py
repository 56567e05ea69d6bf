"""The correctness oracle lives in runtime_glue.checks.reference (the benchmarks use it as their
baseline too); tests import it from here."""

from runtime_glue.checks.reference import OuroReference, SharedDecodeCache

__all__ = ["OuroReference", "SharedDecodeCache"]
