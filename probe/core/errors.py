"""The one exception type the CLI turns into a single line on stderr and exit code 2."""


class HeadprobeError(Exception):
    """A problem with the user's input or environment (not a bug in headprobe).

    The message is one line, says what is wrong and, where possible, how to fix it. The CLI
    prints it as ``headprobe: error: <message>`` and exits with status 2, without a traceback.
    """
