"""The daemon's dispatch: one handler per request class, found on the components that declare them.

A handler is a method marked `@handles(messages.X)`; it takes the parsed request and the Peer beside it
(`server.peers`) and returns its reply object. `Dispatch` collects the marked methods of the components it is given
and refuses, when the daemon is built, an op with no handler or with two: the op table is `expertd.messages.REQUESTS`,
nothing here restates it. Each reply is checked against the class its request declares (`Request.reply_class`) and
made a map here, once; the loop adds what every reply carries (`latest`).
"""

from __future__ import annotations

from expertd.messages import REQUESTS, Request

from .peers import Peer


def handles(cls: type[Request]):
    """Mark a method as the handler of request class `cls`."""
    def mark(method):
        method.handles = cls
        return method
    return mark


class Dispatch:
    def __init__(self, *components):
        self.handlers: dict[type[Request], object] = {}
        for component in components:
            for name in dir(type(component)):
                cls = getattr(getattr(type(component), name, None), "handles", None)
                if cls is None:
                    continue
                if cls in self.handlers:
                    raise TypeError(f"op {cls.op!r} has two handlers: {self.handlers[cls]} and {name}")
                self.handlers[cls] = getattr(component, name)
        missing = [op for op, cls in REQUESTS.items() if cls not in self.handlers]
        if missing:
            raise TypeError(f"no handler for op(s) {', '.join(missing)}")

    def __call__(self, request: Request, peer: Peer) -> dict:
        """Run `request`'s handler; its reply as the map to send (TypeError, a bug: not the class the op declares)."""
        reply = self.handlers[type(request)](request, peer)
        declared = request.reply_class()
        if not isinstance(reply, declared):
            raise TypeError(f"op {request.op!r} answered with {type(reply).__name__}, not the {declared.__name__} "
                            "its request class declares")
        return reply.wire()
