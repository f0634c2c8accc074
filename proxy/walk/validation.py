"""A generate body parsed and checked as vLLM would (``proxy.wire.protocol``), then by the proxy's
own rules; every error is a ``ClientError`` in vLLM's shape, and nothing is held when one is raised."""

from __future__ import annotations

from typing import Any

from kv_transfer.params import client_transfer_params
from proxy.config.settings import ProxySettings
from proxy.wire.errors import BadRequest, InvalidRequest
from proxy.wire.large_body import parse_large_generate_body, prompt_too_long
from proxy.wire.protocol import GenerateRequest, parse_generate_body, utf8_request_body
from proxy.wire.validation_errors import RequestValidationError, VLLMValidationError


class Validation:
    """The checks of one proxy's settings."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings

    def validate(self, body: bytes, content_type: str) -> tuple[GenerateRequest, dict[str, Any]]:
        """``body`` parsed and checked as vLLM would, then by the proxy's own rules."""
        try:
            body = utf8_request_body(body, content_type)  # before any byte-level check
        except RequestValidationError as e:
            raise InvalidRequest.from_protocol(e) from None
        try:
            req, data = parse_generate_body(body, content_type)
        except RequestValidationError as e:
            raise InvalidRequest.from_protocol(e) from None
        except VLLMValidationError as e:
            raise BadRequest.from_protocol(e) from None
        return self._checked(req, data)

    async def validate_large(self, body: bytes | bytearray,
                             content_type: str) -> tuple[GenerateRequest, dict[str, Any]]:
        """``validate`` for a large body, with the same answer; its ids parsed in slices where it can."""
        try:
            body = utf8_request_body(body, content_type)  # before any byte-level check
            req, data = await parse_large_generate_body(body, content_type,
                                                        max_tokens=self.settings.max_prompt_tokens or None)
        except RequestValidationError as e:
            raise InvalidRequest.from_protocol(e) from None
        except VLLMValidationError as e:
            raise BadRequest.from_protocol(e) from None
        return self._checked(req, data)

    def _checked(self, req: GenerateRequest, data: dict[str, Any]) -> tuple[GenerateRequest, dict[str, Any]]:
        """The proxy's own checks of a parsed body."""
        self._prompt_fits(req)
        # Transfer params are set by the proxy only, per hop; a top-level null names nothing and passes.
        where = client_transfer_params(data)
        if where is not None:
            raise BadRequest(f"{where} is set by the proxy for each hop and cannot come from a client: "
                             "remove it from the request.", param=where)
        return self._server_checks(req, data)

    def _prompt_fits(self, req: GenerateRequest) -> None:
        limit = self.settings.max_prompt_tokens
        if limit and len(req.token_ids) > limit:
            raise BadRequest.from_protocol(prompt_too_long(limit, len(req.token_ids)))

    def _server_checks(self, req: GenerateRequest,
                       data: dict[str, Any]) -> tuple[GenerateRequest, dict[str, Any]]:
        s = self.settings
        sp = req.sampling_params
        # The server-level checks of vLLM's serve_tokens, in its order, for the pools' config.
        if s.max_num_seqs is not None and sp.n > s.max_num_seqs:
            raise BadRequest(
                f"sampling_params.n must be at most the server's max_num_seqs ({s.max_num_seqs}), "
                f"got {sp.n}."
            )
        if req.is_stream and sp.get("prompt_logprob_token_ids") is not None:
            raise BadRequest("prompt_logprob_token_ids are not available when stream=true.")
        if s.decode_tokens_only and sp.stop:
            raise BadRequest(
                "stop strings are not supported on a --tokens-only server because detokenization "
                "is disabled. Check stop strings on the coordinator, or use stop_token_ids."
            )
        if s.decode_tokens_only and req.output_mode != "tokens":
            raise BadRequest(
                f"output_mode={req.output_mode!r} requires a tokenizer, but this server does not "
                "load one (--tokens-only or --skip-tokenizer-init). Send the request to a server "
                "that loads a tokenizer, or use output_mode='tokens'."
            )
        return req, data
