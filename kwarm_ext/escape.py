"""One escape for every string that reaches a log line or a terminal from input kwarm does not trust
(a manifest, a ``KWARM_*`` variable, a file name): a leaf module, so that the configuration can use it
without importing the manifest's parser (and what that imports)."""
from __future__ import annotations


def printable(text, limit: int = 200) -> str:
    """`text` safe for a log line or a terminal: control characters and non-ASCII escaped,
    at most `limit` characters."""
    out = str(text).encode("ascii", "backslashreplace").decode("ascii")
    out = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in out)
    return out if len(out) <= limit else out[:limit] + "..."
