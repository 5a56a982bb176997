"""The LoRA adapters a server serves by name (`torchllama.transforms.multi_lora`).

Loaded at start (`serve --adapter NAME=DIR`) or while serving (`/v1/load_lora_adapter`,
`torchllama.serving.api.adapters`), unloaded once no request uses them; a request picks one by
its `model` field. The model's modules change only in the engine thread (`Engine.call`), so a
load never meets a forward pass half-way.
"""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path
from typing import Callable, Optional

from torchllama.errors import TorchLlamaError
from torchllama.serving.api.core import APIError
from torchllama.serving.engine import Engine


class Adapters:
    """The adapters served by name, and how many running requests use each.

    Args:
        engine: the engine whose model they wrap.
        model_name: the base model's name (no adapter may take it).

    Attributes:
        paths: name → the folder it was read from, in load order.
    """

    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.paths: dict[str, str] = {}
        self.unloading: set[str] = set()
        self.in_use: collections.Counter = collections.Counter()

    def load_now(self, name: str, path: str) -> None:
        """Load before the engine runs (server start).

        Raises:
            ModelFileError: not an adapter for this model (see `multi_lora.read_adapter`).
        """
        from torchllama.transforms.multi_lora import add_adapter, install, read_adapter

        adapters = install(self.engine.model)
        add_adapter(adapters, read_adapter(self.engine.model, name, path))
        self.paths[name] = str(path)

    async def load(self, name: str, path: str) -> None:
        """Load while serving: wrap the products (engine thread), read the files (a worker
        thread), attach (engine thread).

        Raises:
            APIError: 400 for a name in use or an adapter that does not load.
        """
        from torchllama.transforms.multi_lora import add_adapter, install, read_adapter

        if not name or name == self.model_name or name in self.paths:
            raise APIError(400, f"lora_name: {name!r} is already the name of a served model",
                           "lora_name")
        if not Path(path).is_dir():
            raise APIError(400, f"lora_path: {path}: no such folder", "lora_path")
        model = self.engine.model
        adapters = await asyncio.wrap_future(self.engine.call(lambda: install(model)))
        try:
            weights = await asyncio.to_thread(read_adapter, model, name, path)
        except TorchLlamaError as e:
            raise APIError(400, f"lora_path: {e}", "lora_path") from None
        if name in self.paths:
            raise APIError(400, f"lora_name: {name!r} was loaded meanwhile", "lora_name")
        self.paths[name] = str(path)
        await asyncio.wrap_future(self.engine.call(lambda: add_adapter(adapters, weights)))

    async def unload(self, name: str) -> None:
        """Stop taking requests for `name`, wait for those using it, then detach it.

        Raises:
            APIError: 404 for a name that is not loaded.
        """
        from torchllama.transforms.multi_lora import remove_adapter

        if name not in self.paths or name in self.unloading:
            raise APIError(404, f"lora_name: no LoRA adapter {name!r} is loaded", "lora_name",
                           "not_found_error")
        self.unloading.add(name)
        try:
            while self.in_use[name] > 0:
                await asyncio.sleep(0.02)
            model = self.engine.model
            await asyncio.wrap_future(self.engine.call(
                lambda: remove_adapter(model, model.adapter_set, name)))
            del self.paths[name]
        finally:
            self.unloading.discard(name)

    def pick(self, model: Optional[str]) -> Optional[str]:
        """The adapter a request's `model` names, or None (the base model).

        Raises:
            APIError: 404 for an adapter being unloaded.
        """
        if model in self.unloading:
            raise APIError(404, f"model: the LoRA adapter {model!r} is being unloaded",
                           "model", "not_found_error")
        return model if model in self.paths else None

    def use(self, name: Optional[str]) -> Optional[Callable[[], None]]:
        """Count one more request using `name`; returns what ends its use (None: the base)."""
        if name is None:
            return None
        self.in_use[name] += 1

        def done() -> None:
            self.in_use[name] -= 1
        return done
