"""The serving engine: an asyncio loop on the Rust scheduler driving worker processes.

```python
async with Engine(EngineConfig(instances=(1, 1))) as engine:
    async for out in engine.generate("12345+67890=", GenerationParams(max_tokens=8)):
        print(out.delta, end="")
```

`EngineClient` runs the same engine core in a process of its own and fronts it (what
`dilaserve serve` does): the front end tokenizes and decodes, the core sees token ids.
"""

from .client import EngineClient
from .config import EngineConfig, GenerationParams
from .engine import Engine, InstanceRecord
from .errors import (
    BadRequestError,
    EngineError,
    EngineStoppedError,
    LaunchError,
    OverloadedError,
    RequestCancelledError,
    RequestFailedError,
    UnknownRequestError,
)
from .launcher import Launcher, LocalLauncher, WorkerHandle, WorkerSpec
from .offline import LLM
from .requests import RequestOutput, RequestStats

__all__ = [
    "LLM",
    "BadRequestError",
    "Engine",
    "EngineClient",
    "EngineConfig",
    "EngineError",
    "EngineStoppedError",
    "GenerationParams",
    "InstanceRecord",
    "LaunchError",
    "Launcher",
    "LocalLauncher",
    "OverloadedError",
    "RequestCancelledError",
    "RequestFailedError",
    "RequestOutput",
    "RequestStats",
    "UnknownRequestError",
    "WorkerHandle",
    "WorkerSpec",
]
