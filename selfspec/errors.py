"""The one error type users see: its message says what to fix."""


class SelfspecError(Exception):
    """Bad input or an unusable model; the CLI prints the message and exits non-zero."""
