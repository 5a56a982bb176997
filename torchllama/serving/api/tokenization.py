"""`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`: vLLM's tokenizer endpoints
(what lm-evaluation-harness's `remote` tokenizer backend reads), over the served model's own
tokenizer, so that a client counts, splits and scores exactly the tokens the model sees.

    /tokenize        {"prompt": text, "add_special_tokens": true} → {"count", "max_model_len",
                     "tokens", "token_strs"}: special-token strings in the text (`<|im_end|>`)
                     are their tokens, as transformers' tokenizers do; add_special_tokens adds BOS
                     where the model expects one. Or {"messages": [...]} (chat): the prompt the
                     chat template makes of them.
    /detokenize      {"tokens": [...]} → {"prompt": text}
    /tokenizer_info  the tokenizer's class and special tokens, the chat template, the context

Source: vLLM's `entrypoints/serve/tokenize` API (request and response shapes).
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

from fastapi import Request as HTTPRequest
from pydantic import BaseModel, ConfigDict

from torchllama.serving.api.core import APIError, Service
from torchllama.serving.api.schemas import TEXT_MESSAGES, TokenId, described


#: the chat roles /tokenize takes
ROLES = ("system", "developer", "user", "assistant", "tool")


class TokenizeBody(BaseModel):
    """vLLM's /tokenize body: a prompt, or chat messages (OpenAI's, as dicts)."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]},
                                                           {"required": ["messages"]}]})
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Annotated[Optional[list[dict[str, Any]]], described(TEXT_MESSAGES)] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeBody(BaseModel):
    model: Optional[str] = None
    tokens: list[TokenId]


def _tokens(body: TokenizeBody, service: Service) -> list[int]:
    """The token ids of a /tokenize body.

    Raises:
        APIError: 400 without exactly one of prompt and messages, or messages the chat
            template refuses.
    """
    tokenizer = service.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt (text) or messages (chat)", "prompt")
    if body.prompt is not None:
        service.check_texts([body.prompt], "prompt")
        ids = tokenizer.encode(body.prompt, special=True)
        if body.add_special_tokens and tokenizer.add_bos and tokenizer.bos_id is not None \
                and ids[:1] != [tokenizer.bos_id]:
            ids = [tokenizer.bos_id] + ids
        return ids
    from torchllama.serving.tools import ToolError, tools_of

    try:
        tools = tools_of(body.tools, None, None)
    except ToolError as e:
        raise APIError(400, str(e), e.param) from None
    for i, m in enumerate(body.messages):
        if m.get("role") not in ROLES or not isinstance(m.get("content") or "", str):
            raise APIError(400, f"messages[{i}]: a message has a role ({', '.join(ROLES)}) "
                                "and text content", f"messages[{i}]")
    return service.encode_chat([{**m, "content": m.get("content") or ""}
                                for m in body.messages], tools, body.chat_template_kwargs)


async def tokenize(body: TokenizeBody, http: HTTPRequest) -> dict:
    """POST /tokenize."""
    service: Service = http.app.state.service
    ids = _tokens(body, service)
    strs = [service.tokenizer.id_to_piece(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": service.context, "tokens": ids,
            "token_strs": strs}


async def detokenize(body: DetokenizeBody, http: HTTPRequest) -> dict:
    """POST /detokenize (400: a token id outside the vocabulary)."""
    tokenizer = http.app.state.service.tokenizer
    if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= tokenizer.vocab_size):
        raise APIError(400, f"tokens: token ids must be in [0, {tokenizer.vocab_size})",
                       "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


async def tokenizer_info(http: HTTPRequest) -> dict:
    """GET /tokenizer_info."""
    service: Service = http.app.state.service
    tokenizer = service.tokenizer

    def text(i: Optional[int]) -> Optional[str]:
        return None if i is None else tokenizer.id_to_piece(i)

    return {"tokenizer_class": type(tokenizer).__name__, "bos_token": text(tokenizer.bos_id),
            "eos_token": text(tokenizer.eos_id), "pad_token": text(tokenizer.pad_id),
            "unk_token": text(tokenizer.unk_id), "add_bos_token": tokenizer.add_bos,
            "add_eos_token": tokenizer.add_eos, "chat_template": tokenizer.chat_template,
            "vocab_size": tokenizer.vocab_size, "model_max_length": service.context}
