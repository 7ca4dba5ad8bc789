"""Answer every RPC the fake does not serve with ``UNIMPLEMENTED``, as a real server would."""

from __future__ import annotations

from typing import Any

from grpclib import GRPCError, Status


def unimplemented_mixin(base: type) -> type:
    """A class with one handler per abstract method of ``base``, each raising UNIMPLEMENTED.

    Put it before ``base`` in the bases; methods the fake defines itself take precedence.
    """

    def handler_for(name: str) -> Any:
        async def handler(self: Any, stream: Any) -> None:
            raise GRPCError(Status.UNIMPLEMENTED, f"fake Modal does not serve {name}")

        handler.__name__ = name
        return handler

    methods = {name: handler_for(name) for name in base.__abstractmethods__}  # type: ignore[attr-defined]
    return type(f"Unimplemented{base.__name__}", (), methods)
