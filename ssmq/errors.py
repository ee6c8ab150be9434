"""The one exception type users see: its message is a single line saying what is wrong."""


class SSMQError(Exception):
    """A user-facing error (bad input, missing file, unsupported combination); the CLI prints it and exits 1."""
