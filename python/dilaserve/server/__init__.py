"""The OpenAI-compatible HTTP server on the engine (`dilaserve serve`)."""

from .app import Server, ServerSettings
from .run import bind, serve

__all__ = ["Server", "ServerSettings", "bind", "serve"]
