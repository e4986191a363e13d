"""`PromptIds`: the token ids a request body's prompt will have on a worker, for routing.

The router routes on tokens, not text, and on the whole prompt the worker will compute: a chat
request goes through the model's chat template exactly as the worker's tokenizer side does
(`tokenizer_proc.input_processor`), so a conversation is routed on its full rendered history,
not its first message. Bodies the worker would reject route as an empty prompt (a miss: the
least loaded worker answers with the error).
"""

from __future__ import annotations

from typing import Any

from radixrt.server.protocol import messages_from, template_options
from radixrt.server.responses import chat_body
from radixrt.server.tools import prompt_messages, tool_request_from
from tokenizer_proc.input_processor import InputProcessor


class PromptIds:
    def __init__(self, tokenizer: Any):
        # Only `tokenize` / `apply_chat_template` are used: no vocabulary or context checks
        # (the worker does those and answers with the error).
        self._inputs = InputProcessor(tokenizer, vocab_size=len(tokenizer),
                                      max_context_len=1 << 62)

    def of(self, path: str, body: dict[str, Any]) -> list[int]:
        """Token ids of the first prompt of `body` sent to `path` ([] if there is none)."""
        try:
            if path.endswith("/chat/completions"):
                return self._chat(body)
            if path.endswith("/responses"):
                # The stored conversation that `previous_response_id` adds on the worker is
                # not known here: such a request goes to the response's owner instead.
                return self._chat(chat_body(body, []))
            return self._completion(body.get("prompt"))
        except Exception:  # the worker reports bad input with the proper error
            return []

    def _chat(self, body: dict[str, Any]) -> list[int]:
        """A chat request's prompt as the worker renders it: its tools and tool-call history
        through the template, or as the fallback block and text when the template takes no
        tools (`radixrt.server.tools.prompt_messages`)."""
        messages, tools = prompt_messages(messages_from(body), tool_request_from(body),
                                          self._inputs.template_takes_tools())
        return self._inputs.apply_chat_template(messages, tools, **template_options(body))

    def _completion(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return self._inputs.tokenize(prompt)
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, int):
                return [t for t in prompt if isinstance(t, int)]
            if isinstance(first, str):
                return self._inputs.tokenize(first)
            if isinstance(first, list):
                return [t for t in first if isinstance(t, int)]
        return []
