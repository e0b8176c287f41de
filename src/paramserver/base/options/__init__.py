"""The options of a run: one `Options` field per option (options.py), the field metadata that makes
its command-line flag and its docs rows (fields.py), and the range and consistency checks (checks.py)."""

from paramserver.base.options.options import Options

__all__ = ["Options"]
