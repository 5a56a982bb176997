"""The LoRA adapters a server serves by name (`torchllama.transforms.multi_lora`).

Loaded at start (`serve --adapter NAME=DIR`) or while serving (`/v1/load_lora_adapter`,
`torchllama.serving.api.adapters`), unloaded once no request uses them; a request picks one by
its `model` field. The model's modules change only in the engine thread (`Engine.call`), so a
load never meets a forward pass half-way.

Loading while serving makes the server read a folder a caller names, so it is off unless
`serve --allow-adapter-loading` (or TORCHLLAMA_ALLOW_ADAPTER_LOADING=1, as vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING); with `--adapter-root ROOT` the folder must be inside ROOT
(a relative path is taken from ROOT; no `..`, nothing that resolves out of it through a
symlink), and an adapter is checked against the model (`multi_lora.check_adapter`) before the
engine sees it: a bad one is a 400 and the server goes on serving.
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

    def __init__(self, engine: Engine, model_name: str, allow_loading: bool = False,
                 root: Optional[str] = None):
        self.engine, self.model_name = engine, model_name
        self.allow_loading = allow_loading
        self.root = Path(root).resolve() if root is not None else None
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
            APIError: 403 when runtime loading is off or the folder is outside the adapter
                root; 400 for a name in use, a path with `..`, a missing folder, or an adapter
                that fails its checks (the message names the file and what is wrong).
        """
        from torchllama.transforms.multi_lora import (add_adapter, check_adapter, install,
                                                      read_adapter)

        self.check_allowed()
        if not name or name == self.model_name or name in self.paths:
            raise APIError(400, f"lora_name: {name!r} is already the name of a served model",
                           "lora_name")
        folder = self.resolve(path)
        model = self.engine.model
        try:
            await asyncio.to_thread(check_adapter, model, folder)     # before the engine
        except TorchLlamaError as e:
            raise APIError(400, f"lora_path: {e}", "lora_path") from None
        adapters = await asyncio.wrap_future(self.engine.call(lambda: install(model)))
        try:
            weights = await asyncio.to_thread(read_adapter, model, name, folder)
        except TorchLlamaError as e:
            raise APIError(400, f"lora_path: {e}", "lora_path") from None
        if name in self.paths:
            raise APIError(400, f"lora_name: {name!r} was loaded meanwhile", "lora_name")
        self.paths[name] = str(folder)
        await asyncio.wrap_future(self.engine.call(lambda: add_adapter(adapters, weights)))

    def check_allowed(self) -> None:
        """Raises APIError 403 unless runtime loading and unloading are on."""
        if not self.allow_loading:
            raise APIError(403, "loading and unloading adapters at run time is off on this "
                                "server (serve --allow-adapter-loading, or "
                                "TORCHLLAMA_ALLOW_ADAPTER_LOADING=1)", "lora_path",
                           "permission_error")

    def resolve(self, path: str) -> Path:
        """The adapter folder a request names: inside `root` when there is one.

        Raises:
            APIError: 400 for `..` in the path or a folder that does not exist (inside the
                root); 403 for a folder that is (or resolves, through a symlink) outside
                the root, whether or not it exists.
        """
        given = Path(path)
        if ".." in given.parts or "\x00" in path:
            raise APIError(400, "lora_path: '..' (and NUL) are not allowed in an adapter path",
                           "lora_path")
        try:
            return self._inside_root(given, path)
        except OSError as e:                   # a name too long, a folder not readable...
            raise APIError(400, f"lora_path: cannot read it ({e.strerror or e})",
                           "lora_path") from None

    def _inside_root(self, given: Path, path: str) -> Path:
        """`resolve`'s checks of the root and the folder (OSError from the file system)."""
        if self.root is None:
            folder = given.resolve()
        else:
            folder = (self.root / given).resolve()          # (an absolute path stays itself)
            if not folder.is_relative_to(self.root) or \
                    any(not f.resolve().is_relative_to(self.root)
                        for f in (folder.iterdir() if folder.is_dir() else ())):
                raise APIError(403, f"lora_path: adapters are loaded from inside "
                                    f"{self.root} only (serve --adapter-root)", "lora_path",
                               "permission_error")
        if not folder.is_dir():
            raise APIError(400, f"lora_path: {path}: no such folder"
                           + (f" in {self.root}" if self.root is not None else ""),
                           "lora_path")
        return folder

    async def unload(self, name: str) -> None:
        """Stop taking requests for `name`, wait for those using it, then detach it.

        Raises:
            APIError: 403 when runtime loading is off; 404 for a name that is not loaded.
        """
        from torchllama.transforms.multi_lora import remove_adapter

        self.check_allowed()
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
