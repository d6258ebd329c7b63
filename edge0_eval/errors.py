"""Errors shown to users as one clear line (the CLI prints them without a traceback)."""


class Edge0Error(Exception):
    """Bad input or a failed precondition, with a message naming the file or option and the fix."""


class CheckpointError(Edge0Error):
    """A checkpoint, index or expert file is missing, truncated or inconsistent."""


class ConfigError(Edge0Error):
    """An option or config value is invalid."""
