"""The runtime's own error: its home is apart from the launcher so that the cluster code (which
the launcher uses to watch other tasks) can raise it without importing the launcher."""


class CollectiveError(RuntimeError):
  """A collective of the per-partition program failed or timed out; says which and where."""
