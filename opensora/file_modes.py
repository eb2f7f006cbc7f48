"""Files written through a temporary file get the permissions a plain ``open()`` would have given them.

``tempfile.mkstemp`` creates its file 0600 whatever the umask (it is meant to be private), and ``os.replace`` keeps
that mode, so a config or a sidecar written atomically would be unreadable to the group and others that can read
the videos beside it. ``match_umask`` sets the mode ``open()`` uses: 0666 minus the process umask.
"""

import os


def current_umask() -> int:
    """The process umask, read without changing it where Linux exposes it (``os.umask`` sets it to read it, which
    would race with another thread creating a file)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def match_umask(path) -> None:
    """Give ``path`` (a temporary file about to be renamed into place) the mode ``open()`` would have."""
    os.chmod(path, 0o666 & ~current_umask())
