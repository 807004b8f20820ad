"""What the services served beside KVKeeper (KVKeeperAdmin, KVKeeperResidency)
share: the data servicer's drain flag and metrics, and namespace ids."""
from __future__ import annotations

from typing import Any

from ..errors import InvalidArgument
from ..ids import NamespaceId

NAMESPACE_ID_BYTES = 16


class Sibling:
    """A servicer beside the KVKeeperServicer `data`: refused while it drains
    (handler.py reads `serving`), its calls counted with the data servicer's
    (one drain waits for all) and in its metrics."""

    data: Any

    @property
    def serving(self) -> bool:
        return bool(self.data.serving)

    @property
    def calls(self) -> Any:
        return self.data.calls

    @property
    def metrics(self) -> Any:
        return getattr(self.data, "metrics", None)


def namespace_id(raw: bytes) -> NamespaceId:
    """A namespace id from a request, or InvalidArgument."""
    if len(raw) != NAMESPACE_ID_BYTES:
        raise InvalidArgument(f"a namespace id has {NAMESPACE_ID_BYTES} bytes "
                              f"({2 * NAMESPACE_ID_BYTES} hex digits), got {len(raw)}; "
                              "`kvkeeper ls` shows them")
    return NamespaceId(bytes(raw))
