"""The client's mistakes, as both transports report them."""


class RequestError(ValueError):
    """A request the server refuses (gRPC INVALID_ARGUMENT, HTTP 400); the message starts with
    the field it names (`sampling.top_p=2.0: ...`, `tools[1].function.name=...: ...`)."""
