"""The function tools (OpenAI `tools` entries) that bench/tools_agent.py and
scripts/tool_call_check.py offer the model, and the pieces they share.

The two scripts' lists differ on purpose (the agent also books hotels and bounds the city's
length; the check describes the city): their published figures were measured with these exact
schemas, so a change here changes the prompts and the grammars of both. Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def function_tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    """A `tools` entry: a function whose arguments are an object with exactly `properties`, all
    of them required."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": list(properties), "additionalProperties": False}}}


def schemas(tools: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's arguments schema, by function name."""
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}


UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
CURRENCY_CODE = {"type": "string", "maxLength": 3}
CONVERT_CURRENCY = function_tool(
    "convert_currency", "Convert an amount between currencies",
    {"amount": {"type": "number"}, "source": CURRENCY_CODE, "target": CURRENCY_CODE})
