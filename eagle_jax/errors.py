"""User-facing errors.

Anything a user can cause (a bad model name, a missing or corrupt file, an empty or
too-long prompt) raises :class:`EagleJaxError`. The CLI prints it as one line without
a traceback; library callers can catch it.
"""


class EagleJaxError(Exception):
  """An error caused by user input, reported as a single line."""

  def __init__(self, message: str):
    super().__init__(" ".join(str(message).split()))
