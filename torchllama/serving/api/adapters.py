"""`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`: vLLM's runtime LoRA endpoints
over the server's `torchllama.serving.adapters.Adapters`; a request then picks an adapter by
its `model` field.

Source: vLLM's "Dynamically serving LoRA adapters" (its bodies and answers).
"""

from __future__ import annotations

from typing import Optional

from fastapi import Request as HTTPRequest
from pydantic import BaseModel, Field


class LoadAdapterBody(BaseModel):
    """vLLM's /v1/load_lora_adapter body: the name requests will use as `model`, and the PEFT
    folder (or `torchllama finetune` run)."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadAdapterBody(BaseModel):
    """vLLM's /v1/unload_lora_adapter body."""
    lora_name: str
    lora_int_id: Optional[int] = None


async def load(body: LoadAdapterBody, http: HTTPRequest) -> dict:
    """POST /v1/load_lora_adapter (400: a name in use, a folder that is not an adapter of
    this model)."""
    await http.app.state.service.adapters.load(body.lora_name, body.lora_path)
    return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "loaded"}


async def unload(body: UnloadAdapterBody, http: HTTPRequest) -> dict:
    """POST /v1/unload_lora_adapter (404: no such adapter)."""
    await http.app.state.service.adapters.unload(body.lora_name)
    return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"}
