"""The root of every error this project raises on purpose.

Each package derives its own from :class:`GatewayCapacityError` (the segment's
in ``shm_layout.segment``, the config's in ``sidecar.config``, admission's in
``handler_shim.admission``), so a caller that means "anything gateway-capacity
refused" catches one name; ``handler_shim`` draws and exports the whole tree.
``str()`` of every one is one line that says what to fix.
"""


class GatewayCapacityError(Exception):
    """Base of the errors gateway-capacity raises on purpose; ``str()`` says what to fix."""
