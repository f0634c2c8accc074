# mypy: disable-error-code="import-not-found,untyped-decorator,unused-ignore"
"""Regenerate tests/proxy/data/validation_cases.json from vLLM's own code (the referee).

Run with the real-vLLM venv (it imports vLLM; no server, no model):
    .venv-vllm/bin/python tests/proxy/gen_validation_cases.py

Each case posts a body to a FastAPI app that declares vLLM's GenerateRequest exactly as
vLLM's router does (validate_json_request dependency, vLLM's exception handlers), and records
the status and JSON body that vLLM answers. Server-level checks that need an engine (n over
max_num_seqs, --tokens-only stop strings, text mode without tokenizer) are not covered here:
they are asserted against the recorded traces instead.
"""



import json
import pathlib
from typing import Any

J = "application/json"
CASES: list[tuple[str, Any, str]] = [
    ("ok-minimal", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}, J),
    ("missing-token-ids", {"sampling_params": {"max_tokens": 2}}, J),
    ("missing-sampling-params", {"token_ids": [1]}, J),
    ("empty-token-ids", {"token_ids": [], "sampling_params": {}}, J),
    ("negative-token-id", {"token_ids": [1, -5], "sampling_params": {}}, J),
    ("token-ids-string", {"token_ids": "hello", "sampling_params": {}}, J),
    ("token-ids-float", {"token_ids": [1.5], "sampling_params": {}}, J),
    ("token-ids-null", {"token_ids": None, "sampling_params": {}}, J),
    ("sampling-params-list", {"token_ids": [1], "sampling_params": [1]}, J),
    ("sampling-params-string", {"token_ids": [1], "sampling_params": "x"}, J),
    ("sampling-params-null", {"token_ids": [1], "sampling_params": None}, J),
    ("output-mode-bogus", {"token_ids": [1], "sampling_params": {}, "output_mode": "bogus"}, J),
    ("output-mode-derender", {"token_ids": [1], "sampling_params": {}, "output_mode": "derender"},
     J),
    ("text-detokenize-false",
     {"token_ids": [1], "sampling_params": {"detokenize": False}, "output_mode": "text"}, J),
    ("max-tokens-zero", {"token_ids": [1], "sampling_params": {"max_tokens": 0}}, J),
    ("max-tokens-string", {"token_ids": [1], "sampling_params": {"max_tokens": "x"}}, J),
    ("min-gt-max", {"token_ids": [1], "sampling_params": {"max_tokens": 3, "min_tokens": 5}}, J),
    ("min-negative", {"token_ids": [1], "sampling_params": {"min_tokens": -1}}, J),
    ("n2-greedy", {"token_ids": [1], "sampling_params": {"temperature": 0, "n": 2}}, J),
    ("temperature-negative", {"token_ids": [1], "sampling_params": {"temperature": -1}}, J),
    ("temperature-high", {"token_ids": [1], "sampling_params": {"temperature": 3}}, J),
    ("top-p-zero", {"token_ids": [1], "sampling_params": {"top_p": 0}}, J),
    ("top-k-bad", {"token_ids": [1], "sampling_params": {"top_k": -2}}, J),
    ("logprobs-negative", {"token_ids": [1], "sampling_params": {"logprobs": -3}}, J),
    ("prompt-logprobs-negative", {"token_ids": [1], "sampling_params": {"prompt_logprobs": -3}},
     J),
    ("stop-empty-string", {"token_ids": [1], "sampling_params": {"stop": [""]}}, J),
    ("stop-detokenize-false", {"token_ids": [1], "sampling_params": {"stop": ["a"], "detokenize": False}},
     J),
    ("stream-string", {"token_ids": [1], "sampling_params": {}, "stream": "maybe"}, J),
    ("kv-params-list", {"token_ids": [1], "sampling_params": {}, "kv_transfer_params": [1]}, J),
    ("unknown-fields", {"token_ids": [1], "sampling_params": {"bogus": 1}, "whatever": 2}, J),
    ("body-list", [1, 2], J),
    ("invalid-json", '{"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2', J),
    ("empty-body", "", J),
    ("wrong-content-type", {"token_ids": [1], "sampling_params": {}}, "text/plain"),
    ("two-errors", {"token_ids": "x"}, J),
]


def main() -> None:
    # vLLM's venv only: imported here so that the project's linters never need it.
    from fastapi import Depends, FastAPI  # noqa: PLC0415
    from fastapi.testclient import TestClient  # noqa: PLC0415
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest  # noqa: PLC0415
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler  # noqa: PLC0415
    from vllm.entrypoints.serve.utils.api_utils import validate_json_request  # noqa: PLC0415

    app = FastAPI()

    class _Args:
        log_error_stack = False

    app.state.args = _Args()
    init_exception_handler(app)

    @app.post("/inference/v1/generate", dependencies=[Depends(validate_json_request)])
    async def generate(request: GenerateRequest) -> dict[str, Any]:
        return {"ok": True}

    out = []
    with TestClient(app, raise_server_exceptions=False) as client:
        for name, body, ctype in CASES:
            raw = body if isinstance(body, str) else json.dumps(body)
            resp = client.post("/inference/v1/generate", content=raw.encode(),
                               headers={"content-type": ctype})
            out.append({"name": name, "body": raw, "content_type": ctype,
                        "status": resp.status_code, "response": resp.json()})
    path = pathlib.Path(__file__).parent / "data" / "validation_cases.json"
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(out)} cases to {path}")


if __name__ == "__main__":
    main()
