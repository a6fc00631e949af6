"""Token-level stop checks, run after each appended output token.

Order (first match wins): a `stop_token_ids` entry (stop_reason = that id),
EOS unless `ignore_eos`, `max_tokens` reached, then the sequence reaching
`max_model_len`. Stop strings are the engine's job (they need detokenized text).
"""

from __future__ import annotations

from asyncpp.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status if its last output token ends it; return whether it did."""
    params = request.sampling_params
    output_token_ids = request.output_token_ids  # (run for every token: no property calls)
    last_token_id = output_token_ids[-1]
    if last_token_id in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
    elif not params.ignore_eos and request.eos_token_id is not None and last_token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
    elif (
        len(output_token_ids) >= params.max_tokens
        or len(request.prompt_token_ids) + len(output_token_ids) >= max_model_len
    ):
        request.status = RequestStatus.FINISHED_LENGTH
    else:
        return False
    return True
