"""The OpenAI-compatible HTTP server on the engine (`dilaserve serve`)."""

from .app import Server, ServerSettings
from .run import bind, serve, serving

__all__ = ["Server", "ServerSettings", "bind", "serve", "serving"]
