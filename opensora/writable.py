"""Whether a directory a command will write into can be written, checked before any work starts.

``os.access`` is not enough: it says yes to root on a read-only filesystem and knows nothing of quotas or ACLs on
network filesystems, so the check creates (and removes) a temporary file in the directory, or in its nearest
existing parent when the directory is still to be created; nothing is left behind either way.
"""

import os
import tempfile
from pathlib import Path

from opensora.cli_errors import UserInputError


def check_writable_dir(path, flag: str) -> None:
    """Raise ``UserInputError`` (one line naming ``flag``) when ``path`` cannot be created or written to."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserInputError(f"{flag} {path}: {existing} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise UserInputError(
            f"{flag} {path} is not writable ({error.strerror or error} in {existing}); choose a writable directory"
        ) from None
