"""Thin helpers over posix_ipc: modes, the permission errors, unlinking.

Nothing here changes the process umask (it is shared by every thread of the
process: a file another thread created in that moment would get our mode).
Objects are created with a mode the umask can only narrow, then given their
final mode on the descriptor (``segment.py``, ``platform.set_semaphore_mode``).
Waiting on a doorbell happens in the compiled core (``Core.dispatch``), which
uses a timed wait only where the platform has one (R-A10, ``platform.py``).
"""

from __future__ import annotations

import posix_ipc

# posix_ipc.PermissionsError is not a PermissionError: catch both wherever an object of
# another user may be met, and turn them into one line that says what to do.
DENIED = (PermissionError, posix_ipc.PermissionsError)

OWNER_ONLY = 0o600
GROUP_SHARED = 0o660


def unlink_semaphore(name: str) -> bool:
    try:
        posix_ipc.unlink_semaphore(name)
    except (posix_ipc.ExistentialError, *DENIED):
        return False
    return True
